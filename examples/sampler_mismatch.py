"""The sampler–trainer check on a real pair: do the records' log π_θ come from the model you train?

Prints, as one JSON object, `sampler_trainer_mismatch` (max and mean |Δ log π_θ| in nats) of samples drawn:

  started       theta as started, against its own transformers copy (float32 on both sides: the noise floor)
  updated       after a state-dict update (a new input embedding, so, tied, a new output projection, and a scaled
                layer), against the updated model
  stale_model   the same samples against the model before the update: what a missed update looks like

    python examples/sampler_mismatch.py             # the SmolLM2 teacher and its 24-layer theta
    python examples/sampler_mismatch.py --quick     # the tiny tied pair, seconds
    python examples/sampler_mismatch.py --engine-dtype bfloat16     # a bfloat16 engine, a float32 trainer
    python examples/sampler_mismatch.py --trainer-dtype bfloat16    # a float32 engine, a bfloat16-autocast trainer

The last two give the figure to set ``max_sampler_mismatch`` from when either side runs bfloat16.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json

import torch
from transformers import AutoModelForCausalLM

from dual_sampling import OptimalSamplingDual, models
from dual_sampling.distill import sampler_trainer_mismatch
from dual_sampling.testing import tiny_models

PROMPTS = [
    "Write a short poem about the sea.",
    "What is 12 + 30?",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]


def figures(mismatch) -> dict:
    return {"max_abs": mismatch.max_abs, "mean_abs": mismatch.mean_abs, "tokens": mismatch.tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny tied pair instead of SmolLM2")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--engine-dtype", default="float32", help="the engines' dtype (default: float32)")
    parser.add_argument(
        "--trainer-dtype", default="float32", help="float32, or bfloat16: the trainer under autocast (default: float32)"
    )
    args = parser.parse_args()
    if args.quick:
        teacher, theta = tiny_models.tiny_pair("same", tied=True)
    else:
        teacher, theta = models.smollm2(), models.smollm2_pruned()
    model = AutoModelForCausalLM.from_pretrained(theta, dtype=torch.float32).eval()
    result = {
        "pair": "tiny-tied" if args.quick else "smollm2",
        "tied": bool(model.config.tie_word_embeddings),
        "engine_dtype": args.engine_dtype,
        "trainer_dtype": args.trainer_dtype,
    }
    bf16 = args.trainer_dtype == "bfloat16"
    trainer = lambda: torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    engine = dict(max_num_seqs=8, max_model_len=1024, use_tqdm=False, dtype=args.engine_dtype)
    with OptimalSamplingDual(teacher, theta, **engine) as s:
        out = s.generate(PROMPTS, max_tokens=args.max_tokens, seed=0, n=2)
        with trainer():
            result["started"] = figures(sampler_trainer_mismatch(model, out.requests, vocab=s.vocab))
        updated = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            embedding = updated.get_input_embeddings().weight
            embedding.add_(0.05 * torch.randn(embedding.shape, generator=generator))
            updated.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        s.update_theta(updated.state_dict(), version="updated")
        out = s.generate(PROMPTS, max_tokens=args.max_tokens, seed=0, n=2)
        with trainer():
            result["updated"] = figures(sampler_trainer_mismatch(updated, out.requests, vocab=s.vocab))
            result["stale_model"] = figures(sampler_trainer_mismatch(model, out.requests, vocab=s.vocab))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
