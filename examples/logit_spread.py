"""How much of the vocabulary an exact decision must exponentiate, on real model rows.

A tail-bounding decision would solve α on the tokens that carry q's mass and bound the
rest without an ``exp``. That only pays if the bound lets it skip most of the vocabulary.
This script teacher-forces a pair (teacher and theta) over the teacher's own sampled
replies to the benchmark's realistic questions and, at every position, finds kl_symmetry's
α in float64 and the share of the vocabulary a tail bound would still have to keep.

The bound, for a cut at log q > −T: the tail holds at most n·e^(−T) of q's mass (n tokens
below the cut), and moving that mass moves E_q[d] (d = log π_t − log π_θ) by at most
n·e^(−T)·max|d − E_q[d]|, hence α by that over Var_q(d). Keeping α within ``--alpha-error``
needs T ≥ ln(V·max|d − E_q[d]| / (alpha_error·Var_q(d))). This is the optimistic case: the
cut is placed knowing the solved α. It also prints how much α changes between consecutive
tokens, which is the distance of the decision's warm start (the previous token's α) from the
root, and what the compiled decision costs on these rows from that warm start.

    python examples/logit_spread.py [--pair smollm2|gemma3] [--alpha-error 1e-6]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from benchmark import chat_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from alpha import get_alpha_computer
from dual_sampling import models
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.rows import ModelRows

CUTS = (15, 20, 25, 30, 35, 40)
"""Fixed cuts T (nats below each row's maximum of either model) to report the head's share at."""


def kl_symmetry_alpha(logp_theta: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    """``[n]`` float64 α solving E_q[d] = 0 on [0, 1] by bisection (E_q[d] rises with α)."""
    d = logp_teacher - logp_theta
    low = torch.zeros(d.shape[0], dtype=torch.float64)
    high = torch.ones(d.shape[0], dtype=torch.float64)
    for _ in range(60):
        mid = 0.5 * (low + high)
        up = (torch.softmax(logp_theta + mid[:, None] * d, -1) * d).sum(-1) > 0
        high, low = torch.where(up, mid, high), torch.where(up, low, mid)
    return 0.5 * (low + high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(models.REAL_PAIRS), default="smollm2")
    parser.add_argument("--alpha-error", type=float, default=1e-6, help="largest α error the tail may cause")
    parser.add_argument("--prompts", type=int, default=6, help="questions from the benchmark's realistic workload")
    parser.add_argument("--tokens", type=int, default=48, help="sampled reply length per prompt")
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher_dir, theta_dir = (build() for build in models.REAL_PAIRS[args.pair])
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    theta = AutoModelForCausalLM.from_pretrained(theta_dir, dtype=torch.float32).eval()

    shares: dict[int, list[float]] = {t: [] for t in CUTS}
    needed_cut, needed_share, alpha_changes = [], [], []
    kernel_rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (teacher, theta, warm start)
    prompts = chat_prompts(tokenizer, args.prompts)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = teacher.generate(ids, max_new_tokens=args.tokens, do_sample=True, top_k=0)
            positions = slice(ids.shape[1] - 1, full.shape[1] - 1)
            logp_t = torch.log_softmax(teacher(full).logits[0, positions].double(), -1)
            logp_h = torch.log_softmax(theta(full).logits[0, positions].double(), -1)
        vocab = logp_t.shape[-1]
        either = torch.maximum(logp_t - logp_t.amax(-1, keepdim=True), logp_h - logp_h.amax(-1, keepdim=True))
        for t in CUTS:
            shares[t] += (either > -t).double().mean(-1).tolist()
        alpha = kl_symmetry_alpha(logp_h, logp_t)
        alpha_changes += (alpha[1:] - alpha[:-1]).abs().tolist()
        kernel_rows.append((logp_t[1:].float(), logp_h[1:].float(), alpha[:-1].float()))
        d = logp_t - logp_h
        logq = torch.log_softmax(logp_h + alpha[:, None] * d, -1)
        q = logq.exp()
        mean = (q * d).sum(-1, keepdim=True)
        var = (q * (d - mean) ** 2).sum(-1)
        spread = (d - mean).abs().amax(-1)
        cut = torch.log(vocab * spread / (args.alpha_error * var.clamp_min(1e-300)))
        needed_cut += cut.tolist()
        needed_share += (logq > -cut[:, None]).double().mean(-1).tolist()

    def summary(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f}  min {min(values):.3f}  max {max(values):.3f}"

    print(f"{args.pair}: V = {vocab}, {len(needed_cut)} positions over {len(prompts)} sampled replies")
    for t in CUTS:
        print(f"  share of V within {t:2d} nats of either model's maximum: {summary(shares[t])}")
    print(
        f"  cut T for an α error <= {args.alpha_error:g}: median {statistics.median(needed_cut):.1f} nats"
        f" ({min(needed_cut):.1f}-{max(needed_cut):.1f}), i.e. q_i > {math.exp(-statistics.median(needed_cut)):.1e}"
    )
    print(f"  share of V above that cut (optimistic: α known): {summary(needed_share)}")
    # How far the decision's warm start (the previous token's α) is from the root.
    print(
        f"  |α change| between consecutive tokens: {summary(alpha_changes)}"
        f"  90th percentile {statistics.quantiles(alpha_changes, n=10)[-1]:.3f}"
    )
    teacher_rows, theta_rows, warm = (torch.cat(parts) for parts in zip(*kernel_rows))
    n = len(warm)
    computer = get_alpha_computer("kl_symmetry")
    times, passes = [], 0
    for _ in range(7):
        start = time.perf_counter()
        _, passes = decide_fused(
            ModelRows.pair(teacher_rows, theta_rows, theta_normalized=True), [0.5] * n, [False] * n, computer, warm
        )
        times.append(time.perf_counter() - start)
    print(
        f"  the compiled decision from that warm start: {passes / n:.2f} α evaluations per row,"
        f" {1e6 * statistics.median(times) / n:.1f} µs/row ({n} rows; the kernel runs on one thread)"
    )


if __name__ == "__main__":
    main()
