"""The float32 spreads behind tests/tolerances.py: ``python -m tests.measure_spread tiny|smollm2`` (one engine pair at
a time; prints one JSON line per measurement).

- ``rescore``: the largest |engine − transformers re-scoring| of log π_t and log π_θ over the sampled tokens;
- ``same_weights_two_engines``: theta given the teacher's weights, the largest |log π_θ − log π_t|;
- ``after_state_dict_update`` (smollm2): theta's weights changed (embedding noise, a scaled layer) and pushed as a
  state dict; the re-scoring spread of the new model.
"""

from __future__ import annotations

import json
import sys

import torch

PROMPTS = ["Once upon a time", "The recipe says", "Count to ten:", "Story 3: the fox went", "12 + 30 =", "Hello there"]


def rescore_spread(dual, hf_teacher, hf_theta, max_tokens: int) -> dict:
    from tests.oracles import rescore

    out = dual.generate(PROMPTS, max_tokens=max_tokens, seed=1, n=2)
    worst, tokens = {"teacher": 0.0, "theta": 0.0}, 0
    for request in out.requests:
        for sample in request.samples:
            ids = torch.tensor(sample.token_ids).unsqueeze(-1)
            for role, model, prompt in (
                ("teacher", hf_teacher, request.teacher_prompt_token_ids),
                ("theta", hf_theta, request.theta_prompt_token_ids),
            ):
                expected = rescore(model, prompt, sample.token_ids, dual.vocab).gather(-1, ids).squeeze(-1)
                got = torch.tensor(getattr(sample, f"logp_{role}"), dtype=torch.float64)
                worst[role] = max(worst[role], float((got - expected).abs().max()))
            tokens += len(sample.token_ids)
    return {**worst, "tokens": tokens}


def main(which: str) -> None:
    from transformers import AutoModelForCausalLM

    from dual_sampling import OptimalSamplingDual, models
    from dual_sampling.testing import tiny_models

    if which == "tiny":
        pairs = [(f"tiny tied={tied}", tiny_models.tiny_pair("same", tied=tied), 512, 48) for tied in (False, True)]
    elif which == "smollm2":
        pairs = [("smollm2", (models.smollm2(), models.smollm2_pruned()), 1024, 32)]
    else:
        raise SystemExit("usage: python -m tests.measure_spread tiny|smollm2")
    for name, (teacher, theta), max_model_len, max_tokens in pairs:
        hf_teacher, hf_theta = (
            AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (teacher, theta)
        )
        with OptimalSamplingDual(
            teacher, theta, max_num_seqs=8, max_model_len=max_model_len, sync_timeout=60, use_tqdm=False
        ) as dual:
            print(
                json.dumps({"pair": name, "rescore": rescore_spread(dual, hf_teacher, hf_theta, max_tokens)}),
                flush=True,
            )
            if which == "smollm2":
                torch.manual_seed(0)
                with torch.no_grad():
                    hf_theta.model.embed_tokens.weight.add_(0.05 * torch.randn_like(hf_theta.model.embed_tokens.weight))
                    hf_theta.model.layers[0].mlp.down_proj.weight.mul_(1.5)
                dual.update_theta(hf_theta.state_dict())
                spread = rescore_spread(dual, hf_teacher, hf_theta, max_tokens)
                print(json.dumps({"pair": name, "after_state_dict_update": spread}), flush=True)
                continue
            dual.update_theta(str(teacher))
            worst = 0.0
            for seed in range(4):
                for request in dual.generate(PROMPTS, max_tokens=32, seed=seed, n=2).requests:
                    for s in request.samples:
                        worst = max([worst, *(abs(a - b) for a, b in zip(s.logp_theta, s.logp_teacher))])
            print(json.dumps({"pair": name, "same_weights_two_engines": worst}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
