"""Micro-benchmark of the alpha solvers and of the whole per-token decision.

Batch 32 of float32 log-probability pairs shaped like real next-token distributions
(random logits at a scale that gives entropies of a few nats), at SmolLM2's V = 49152
and Qwen2.5's V = 152064. Reports the median of several repeats, cold (α starts at 0.5)
and warm (α starts at the previous solution moved by 0.02, as between decoding steps).

    python examples/bench_alpha.py [--repeats 7] [--output docs/alpha_benchmark.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from alpha import get_alpha_computer
from dual_sampling.sampling import RowSampling, decide


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 152064])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", help="write the figures as JSON here")
    args = parser.parse_args()

    rows = []
    for vocab in args.vocab:
        g = torch.Generator().manual_seed(0)
        theta = torch.log_softmax(torch.randn(args.batch, vocab, generator=g) * 2.5, -1)
        teacher = torch.log_softmax(torch.randn(args.batch, vocab, generator=g) * 2.5, -1)
        for method in ("kl_symmetry", "ess_balance", "entropy"):
            ac = get_alpha_computer(method)
            cold_s, cold = timed(lambda ac=ac, th=theta, t=teacher: ac.compute(th, t), args.repeats)
            init = (cold.alpha + 0.02).clamp(0, 1)
            warm_s, warm = timed(
                lambda ac=ac, th=theta, t=teacher, i=init: ac.compute(th, t, alpha_init=i), args.repeats
            )
            rows.append(
                {
                    "vocab": vocab,
                    "method": method,
                    "cold_ms": 1e3 * cold_s,
                    "cold_passes": cold.passes,
                    "warm_ms": 1e3 * warm_s,
                    "warm_passes": warm.passes,
                }
            )
            print(
                f"V={vocab:6d} {method:12s} cold {1e3 * cold_s:7.1f} ms ({cold.passes} passes)"
                f"  warm {1e3 * warm_s:7.1f} ms ({warm.passes} passes)"
            )
        # The whole per-token decision the teacher processor makes (log-softmax, α, mix, draw).
        rows_cfg = [RowSampling(seed=i) for i in range(args.batch)]
        ac = get_alpha_computer("kl_symmetry")
        decide_s, _ = timed(
            lambda t=teacher, th=theta, r=rows_cfg, a=ac: decide(t, th, [1] * args.batch, r, a), args.repeats
        )
        rows.append({"vocab": vocab, "method": "decide(kl_symmetry)", "cold_ms": 1e3 * decide_s})
        print(f"V={vocab:6d} decide       {1e3 * decide_s:7.1f} ms (log-softmax, kl_symmetry, mix, draw)")
    if args.output:
        info = {
            "batch": args.batch,
            "dtype": "float32",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "date": time.strftime("%Y-%m-%d"),
        }
        with open(args.output, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
