"""The distillation loss on samples of q, and the importance weights that move it to θ's own states.

Pure math on tensors; docs/theory.md ("Training θ on samples of q") states the objective, the estimator, its bias
and its variance. Conventions: α is the teacher weight; a sample's per-token log-weight towards θ is
``log w_t = log π_θ(y_t | y_<t) − log q(y_t | y_<t)``, from the records of the policy that drew it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["WEIGHTINGS", "ess_fraction", "state_weights", "top_k_forward_kl"]

WEIGHTINGS = ("none", "token", "sequence_mean", "sequence")
"""How a sample's log-weights become the weight of each of its states in the loss:

- ``none``: every state counts once (the states of q, uncorrected);
- ``token``: the state before token t counts w_t, that token's own ratio (a per-token correction);
- ``sequence_mean``: every state of a sample counts exp(mean_t log w_t), its geometric-mean ratio;
- ``sequence``: every state of a sample counts exp(Σ_t log w_t), the whole sequence's ratio (unbiased for θ's
  sequences, and the one that collapses on long samples).

Each is self-normalised over the batch (mean 1 per token) and then clipped at ``max_weight``."""


def state_weights(log_w: Sequence[Tensor], weighting: str, max_weight: float = math.inf) -> list[Tensor]:
    """The loss weight of each state of each sample: one float64 tensor ``[n_i]`` per sample ``log_w[i]`` ``[n_i]``.

    Self-normalised so that the weights of all tokens of the batch average 1, then clipped at ``max_weight``
    (truncated importance sampling: bias for bounded variance). Weights carry no gradient.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not (max_weight > 0):
        raise ValueError(f"max_weight must be positive, got {max_weight!r}")
    logs = []
    for lw in log_w:
        lw = lw.detach().double()
        if weighting == "none":
            logs.append(torch.zeros_like(lw))
        elif weighting == "token":
            logs.append(lw)
        elif weighting == "sequence_mean":
            logs.append(lw.mean().expand_as(lw) if lw.numel() else lw)
        else:
            logs.append(lw.sum().expand_as(lw))
    flat = torch.cat(logs) if logs else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return [torch.zeros(0, dtype=torch.float64) for _ in logs]
    # exp(x − max) / mean(exp(x − max)): the same ratios, without overflow for log-weights in the hundreds.
    shift = flat.max()
    scale = torch.exp(flat - shift).mean()
    return [torch.clamp(torch.exp(x - shift) / scale, max=max_weight) for x in logs]


def ess_fraction(log_w: Tensor) -> float:
    """Kish's effective sample size of weights given as logs, as a fraction of their number: (Σw)² / (n·Σw²) in
    (0, 1]; 1 when all weights are equal. nan for none."""
    lw = log_w.detach().double().flatten()
    if lw.numel() == 0:
        return math.nan
    w = torch.exp(lw - lw.max())
    return float(w.sum() ** 2 / (lw.numel() * (w * w).sum()))


_LOG_REST_FLOOR = -80.0
"""log of the smallest rest mass the student is credited with (e^-80 ≈ 2e-35)."""


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate at both ends (−inf at x = 0)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def top_k_forward_kl(student_logits: Tensor, top_ids: Tensor, top_logp: Tensor) -> Tensor:
    """KL(π_t ‖ π_θ) per position on the teacher's top k tokens plus one bucket for the rest of the vocabulary.

    ``student_logits`` ``[n, V]`` (any dtype; computed in float32 or wider), ``top_ids`` ``[n, k]`` and ``top_logp``
    ``[n, k]``: the teacher's k most likely tokens and their log π_t (the records' ``dense_*[:, 0]``). Returns ``[n]``
    nats. It is the exact KL between the two distributions coarsened to {top k, rest}, so it never exceeds the full
    KL, equals it when the rest has no teacher mass, and its gradient is the full forward KL's on the top k.
    """
    logp_student = torch.log_softmax(student_logits.float(), dim=-1)
    at_top = logp_student.gather(-1, top_ids.long())
    teacher = top_logp.to(at_top.dtype)
    kl = (teacher.exp() * (teacher - at_top)).sum(-1)
    teacher_rest = _log1mexp(torch.logsumexp(teacher, -1).clamp(max=0.0))
    # Floored: when the top k hold all but rounding of both models' mass, the rest would be 0·log(0/0).
    student_rest = _log1mexp(torch.logsumexp(at_top, -1).clamp(max=0.0)).clamp(min=_LOG_REST_FLOOR)
    has_rest = teacher_rest > -math.inf
    rest = torch.where(has_rest, teacher_rest.exp() * (teacher_rest - student_rest), torch.zeros_like(kl))
    return kl + torch.where(has_rest, rest, torch.zeros_like(rest))
