"""Micro-benchmark of the alpha solvers and of the whole per-token decision.

Batch 32 of float32 log-probability pairs shaped like real next-token distributions
(random logits at a scale that gives entropies of a few nats), at SmolLM2's V = 49,152,
Qwen2.5's V = 152,064 and Gemma 3's V = 262,144, on one thread (an engine decides on its
own core). Reports the median of several repeats, cold (α starts at 0.5) and warm (α starts
at the solution moved by ``--warm-offset``, as it starts from the previous token's α).

The decision's cost is also given per row (µs/row, warm, theta already normalised as the
theta engine delivers it) against its physical floor measured in the same run: one pass
reading both rows (a sum over 2·V float32 values). ``decide_vs_floor`` is their ratio.
The decision runs through the compiled kernel (``dual_sampling.decision.kernel``); the same call
through the torch reference (``fused=False``) is timed beside it. With two teachers (one more teacher row of the
same kind), kl_symmetry's K-teacher solve and the decision (the torch reference: the kernels take one teacher) are
timed beside one teacher's, as ratios.

    python examples/bench_alpha.py [--repeats 7] [--warm-offset 0.07] [--output docs/alpha_benchmark.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.roster import Roster

WARM_OFFSET = 0.07
"""How far a warm start is from the root: the median change of α between consecutive tokens
(0.066 on the SmolLM2 pair over 244 positions, 90th percentile 0.170; ``examples/logit_spread.py``
prints it)."""


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def synthetic_pair(batch: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher, theta) ``[batch, vocab]`` float32 log-probabilities with entropies of a few nats, as models give."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.log_softmax(torch.randn(batch, vocab, generator=g) * 2.5, -1)
    teacher = torch.log_softmax(torch.randn(batch, vocab, generator=g) * 2.5, -1)
    return teacher, theta


def kernel_parts(
    teacher: torch.Tensor, theta: torch.Tensor, computer, warm: torch.Tensor, repeats: int
) -> dict[str, float]:
    """The compiled kernel's passes timed one by one, µs per row, and the passes a warm row makes.

    An exact decision from a warm start makes at least three passes that exponentiate every
    entry: the teacher's log-normaliser (in the read that also finds both maxima), the α
    evaluation the step is taken from (a warm start is never within tolerance of the root),
    and the evaluation at the accepted α, whose block sums the draw reuses. Their sum,
    ``three_exp_passes_us_per_row``, is the least this design can cost. (The kernel's
    functions are private; this is a profile of them.)
    """
    from dual_sampling.decision import kernel

    t, h = teacher.numpy(), theta.numpy()
    blocks = np.empty(-(-t.shape[1] // kernel._BLOCK))
    maxima = [kernel._maxima_and_log_normalisers(t[r], h[r], True) for r in range(len(t))]

    def per_row(part) -> float:
        part(0)  # called from Python, each pass compiles for these argument types first: not timed
        seconds, _ = timed(lambda: [part(r) for r in range(len(t))], repeats)
        return 1e6 * seconds / len(t)

    def evaluate(pass_function, r: int):
        t_max, h_max, lse_t, _, _ = maxima[r]
        return pass_function(h[r], t[r], 0.5, h_max, t_max, lse_t - float(t_max) + float(h_max), blocks)

    read = per_row(lambda r: kernel._maxima_and_log_normalisers(t[r], h[r], True))
    plain = per_row(lambda r: evaluate(kernel._tilted_pass, r))
    series = per_row(lambda r: evaluate(kernel._tilted_pass_with_series, r))
    _, passes = kernel.decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), [0.5] * len(t), [False] * len(t), computer, warm
    )
    return {
        "read_pass_us_per_row": read,
        "evaluation_us_per_row": plain,
        "first_evaluation_us_per_row": series,
        "evaluations_per_row": passes / len(t),
        "three_exp_passes_us_per_row": read + series + plain,
    }


def decision_cost(
    teacher: torch.Tensor, theta: torch.Tensor, repeats: int, warm_offset: float = WARM_OFFSET
) -> dict[str, float]:
    """µs per row of ``decide()`` as the teacher processor calls it, against one read of both rows.

    ``teacher`` ``[B, V]`` holds logits (or log-probabilities), ``theta`` ``[B, V]``
    log-probabilities (the theta engine normalises them). α is warm: the solution moved by
    ``warm_offset``. The same call through the torch reference is timed beside it.
    """
    batch = teacher.shape[0]
    rows = [RowSampling(seed=i) for i in range(batch)]
    computer = get_alpha_computer("kl_symmetry")
    warm = (computer.compute(theta, teacher).alpha + warm_offset).clamp(0, 1)

    def run(fused: bool):
        return decide(
            ModelRows.pair(teacher, theta, theta_normalized=True), [1] * batch, rows, computer, warm, fused=fused
        )

    kernel_s, _ = timed(lambda: run(True), repeats)
    reference_s, _ = timed(lambda: run(False), repeats)
    # The floor: every row of both sides read once, nothing written.
    floor_s, _ = timed(lambda: teacher.sum(-1) + theta.sum(-1), max(repeats, 21))
    parts = kernel_parts(teacher, theta, computer, warm, repeats)
    return {
        "us_per_row": 1e6 * kernel_s / batch,
        "floor_us_per_row": 1e6 * floor_s / batch,
        "decide_vs_floor": kernel_s / floor_s,
        "three_exp_passes_vs_floor": parts["three_exp_passes_us_per_row"] * batch / (1e6 * floor_s),
        **parts,
        "reference_us_per_row": 1e6 * reference_s / batch,
        "kernel_speedup": reference_s / kernel_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 152064, 262144])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (an engine decides on one core)")
    parser.add_argument("--warm-offset", type=float, default=WARM_OFFSET, help="distance of a warm start from α's root")
    parser.add_argument("--output", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    for vocab in args.vocab:
        teacher, theta = synthetic_pair(args.batch, vocab)
        for method in ("kl_symmetry", "ess_balance", "entropy"):
            ac = get_alpha_computer(method)
            cold_s, cold = timed(lambda ac=ac, th=theta, t=teacher: ac.compute(th, t), args.repeats)
            init = (cold.alpha + args.warm_offset).clamp(0, 1)
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
        # Two teachers: kl_symmetry's K-teacher form (alpha/simplex.py) on one more teacher row of the same kind.
        teachers = torch.stack([teacher, synthetic_pair(args.batch, vocab, seed=1)[0]])
        ac = get_alpha_computer("kl_symmetry")
        cold_s, cold = timed(lambda ac=ac, th=theta, ts=teachers: ac.compute_teachers(th, ts), args.repeats)
        init = (cold.alpha + args.warm_offset / 2).clamp(0, 1)  # the total moved by the offset, shared
        warm_s, warm = timed(
            lambda ac=ac, th=theta, ts=teachers, i=init: ac.compute_teachers(th, ts, alpha_init=i), args.repeats
        )
        pair = next(r for r in rows if r["vocab"] == vocab and r["method"] == "kl_symmetry")
        rows.append(
            {
                "vocab": vocab,
                "method": "kl_symmetry, 2 teachers",
                "cold_ms": 1e3 * cold_s,
                "cold_passes": cold.passes,
                "warm_ms": 1e3 * warm_s,
                "warm_passes": warm.passes,
                "cold_vs_one_teacher": 1e3 * cold_s / pair["cold_ms"],
                "warm_vs_one_teacher": 1e3 * warm_s / pair["warm_ms"],
            }
        )
        print(
            f"V={vocab:6d} kl_sym, 2 t. cold {1e3 * cold_s:7.1f} ms ({cold.passes} passes)"
            f"  warm {1e3 * warm_s:7.1f} ms ({warm.passes} passes)"
            f"  ({rows[-1]['cold_vs_one_teacher']:.1f}x / {rows[-1]['warm_vs_one_teacher']:.1f}x one teacher's)"
        )
        # The whole per-token decision the teacher processor makes (log-softmax, α, mix, draw).
        rows_cfg = [RowSampling(seed=i) for i in range(args.batch)]
        ac = get_alpha_computer("kl_symmetry")
        decide_s, _ = timed(
            lambda t=teacher, th=theta, r=rows_cfg, a=ac: decide(ModelRows.pair(t, th), [1] * args.batch, r, a),
            args.repeats,
        )
        rows.append({"vocab": vocab, "method": "decide(kl_symmetry)", "cold_ms": 1e3 * decide_s})
        print(f"V={vocab:6d} decide       {1e3 * decide_s:7.1f} ms (log-softmax, kl_symmetry, mix, draw)")
        trio = ModelRows((teachers[0], teachers[1], theta), Roster(("teacher", "second", "theta")))
        trio_s, _ = timed(lambda m=trio, r=rows_cfg, a=ac: decide(m, [1] * args.batch, r, a), args.repeats)
        rows.append(
            {
                "vocab": vocab,
                "method": "decide(kl_symmetry, 2 teachers), torch reference",
                "cold_ms": 1e3 * trio_s,
                "vs_one_teacher": trio_s / decide_s,
            }
        )
        print(f"V={vocab:6d} decide, 2 t. {1e3 * trio_s:7.1f} ms ({trio_s / decide_s:.1f}x one teacher's decide)")
        figures = decision_cost(teacher, theta, args.repeats, args.warm_offset)
        rows.append({"vocab": vocab, "method": "decide per row (warm, theta normalised)", **figures})
        print(
            f"V={vocab:6d} decide/row   {figures['us_per_row']:7.1f} us  floor (one read of both rows)"
            f" {figures['floor_us_per_row']:6.1f} us  ratio {figures['decide_vs_floor']:5.1f} (target <= 2)"
            f"  torch reference {figures['reference_us_per_row']:7.1f} us ({figures['kernel_speedup']:.1f}x slower)"
        )
        print(
            f"V={vocab:6d} kernel parts: read pass {figures['read_pass_us_per_row']:.1f} us, first evaluation"
            f" {figures['first_evaluation_us_per_row']:.1f} us, evaluation {figures['evaluation_us_per_row']:.1f} us,"
            f" {figures['evaluations_per_row']:.2f} evaluations per row; the least three exp passes"
            f" {figures['three_exp_passes_us_per_row']:.1f} us = {figures['three_exp_passes_vs_floor']:.1f}x floor"
        )
    if args.output:
        info = {
            "batch": args.batch,
            "warm_offset": args.warm_offset,
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
