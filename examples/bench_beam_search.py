"""Beam search over q against vLLM's own beam search on the teacher alone, side by side in one run.

    python examples/bench_beam_search.py                 # SmolLM2 and its 24-layer prune, width 4
    python examples/bench_beam_search.py --quick         # the tiny pair, to check the script

``--prompts`` held-out GSM8K questions (examples/data/gsm8k), each searched with ``--width`` beams for ``--tokens``
steps (EOS ignored, so both searches run every step). vLLM's ``LLM.beam_search`` runs on the teacher with the cores
lockstep gives the teacher (one engine, the same cache size per sequence); ``OptimalSamplingDual.beam_search`` runs
the pair (kl_symmetry). Both generate one-token requests per live beam and step, with prefix caching on. The runs
alternate, ``--repeats`` times each. Reported: median wall seconds of each, and their ratio as a throughput ratio
(searched tokens per second of the mixture over vLLM's; target ≥ 0.6). Writes docs/beam_search_benchmark.json unless
``--output`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dual_sampling import OptimalSamplingDual, models  # noqa: E402
from dual_sampling.driver.engine_processes import engine_cpus, split_cpu_binding  # noqa: E402
from dual_sampling.options import default_kv_cache_bytes  # noqa: E402
from dual_sampling.testing import tiny_models  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "subset.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ROOT / "docs" / "beam_search_benchmark.json"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-layers", type=int, default=24, help="theta: SmolLM2 with this many of its 30 layers")
    parser.add_argument("--quick", action="store_true", help="the tiny pair, small sizes")
    args = parser.parse_args()
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    if args.quick:
        teacher, theta = (str(p) for p in tiny_models.tiny_pair())
        args.prompts, args.width, args.tokens, args.repeats = 1, 2, 4, 1
    else:
        teacher, theta = str(models.smollm2()), str(models.smollm2_pruned(args.keep_layers))
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False
        )
        for r in rows[-args.prompts :]
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    max_len = max(len(p) for p in prompts) + args.tokens + 8
    seqs = args.prompts * 2 * args.width  # vLLM's beam search submits 2·width candidates' worth of requests at most
    with engine_cpus(split_cpu_binding().get("teacher")):
        llm = LLM(
            model=teacher,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=seqs,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=default_kv_cache_bytes(teacher, seqs, max_len),
            seed=0,
        )
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
    vllm_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.beam_search(vllm_prompts[:1], BeamSearchParams(beam_width=args.width, max_tokens=2))  # warm-up
    times: dict[str, list[float]] = {"vllm_teacher": [], "mixture": []}
    with OptimalSamplingDual(
        teacher, theta, alpha_method="kl_symmetry", max_num_seqs=seqs, max_model_len=max_len, use_tqdm=False
    ) as dual:
        dual.beam_search(prompts[:1], beam_width=args.width, max_tokens=2)  # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.beam_search(vllm_prompts, params)
            times["vllm_teacher"].append(time.perf_counter() - start)
            start = time.perf_counter()
            dual.beam_search(prompts, beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
            times["mixture"].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "command": "python examples/bench_beam_search.py" + (" --quick" if args.quick else ""),
        "teacher": Path(teacher).name,
        "theta": Path(theta).name,
        "prompts": args.prompts,
        "beam_width": args.width,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "runs_s": {name: [round(x, 3) for x in t] for name, t in times.items()},
        "median_s": {name: round(x, 3) for name, x in median.items()},
        "searched_tokens_per_s": {name: round(args.prompts * args.tokens / x, 3) for name, x in median.items()},
        "mixture_over_vllm_throughput": round(median["vllm_teacher"] / median["mixture"], 3),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
