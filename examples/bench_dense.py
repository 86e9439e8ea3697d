"""Benchmark: what the dense teacher signal (``dense_logprobs`` k) costs a generation, side by side in one run.

One dual engine (default: the SmolLM2 teacher and its 24-layer theta) started with ``max_dense_logprobs`` at the
largest k asked for; the same batch is generated with k = 0 and each other k in turn, --repeats rounds, so every
setting sees the same machine state. Reported per k: the median decode throughput (tokens/s) and its ratio to
k = 0's, and the bytes of dense records per token, read off the records (ids and both models' log-probabilities at
both models' top k: 24·k).

    python examples/bench_dense.py --output bench-out/dense.json
    python examples/bench_dense.py --quick          # the tiny pair, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from dual_sampling import OptimalSamplingDual, models
from dual_sampling.testing import tiny_models

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show the steps.",
    "Describe a cat to someone who has never seen one.",
    "Give a recipe for a simple tomato soup.",
    "Why do leaves change colour in autumn?",
    "Name the planets of the solar system in order.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny random pair instead of SmolLM2")
    parser.add_argument("--ks", default="0,20,64,256", help="dense_logprobs values to compare (0 first)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench-out/dense.json")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    teacher, theta = tiny_models.tiny_pair("same") if args.quick else (models.smollm2(), models.smollm2_pruned(24))
    rates: dict[int, list[float]] = {k: [] for k in ks}
    sizes: dict[int, float] = {}
    with OptimalSamplingDual(
        teacher, theta, max_num_seqs=8, max_model_len=512, use_tqdm=False, max_dense_logprobs=max(ks)
    ) as s:
        s.generate(PROMPTS[:2], max_tokens=4)  # warm-up
        for _ in range(args.repeats):
            for k in ks:
                t0 = time.perf_counter()
                out = s.generate(
                    PROMPTS, max_tokens=args.max_tokens, min_tokens=args.max_tokens, seed=1, dense_logprobs=k
                )
                tokens = sum(len(x.token_ids) for r in out.requests for x in r.samples)
                rates[k].append(tokens / (time.perf_counter() - t0))
                dense = [(x.dense_ids, x.dense_logp, x.dense_other_logp) for r in out.requests for x in r.samples]
                sizes[k] = sum(a.nbytes for d in dense if d[0] is not None for a in d) / tokens
    base = statistics.median(rates[ks[0]])
    result = {
        "machine": platform.processor() or platform.machine(),
        "pair": [str(teacher), str(theta)],
        "batch": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "per_k": {
            str(k): {
                "tokens_per_s_median": statistics.median(r),
                "tokens_per_s": r,
                "ratio_to_k0": statistics.median(r) / base,
                "bytes_per_token": sizes[k],
            }
            for k, r in rates.items()
        },
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    for k in ks:
        row = result["per_k"][str(k)]
        print(f"k={k:4d}  {row['tokens_per_s_median']:7.1f} tok/s  ratio {row['ratio_to_k0']:.3f}")


if __name__ == "__main__":
    main()
