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

__all__ = [
    "LOSSES",
    "WEIGHTINGS",
    "ess_fraction",
    "recorded_reverse_kl",
    "recorded_teacher_logp",
    "state_weights",
    "top_k_forward_kl",
]

LOSSES = ("forward", "reverse", "reverse_full")
"""The per-position divergence a distillation run minimises (docs/theory.md):

- ``forward``: KL(π_t ‖ π_θ) on the teacher's top k plus a rest bucket (:func:`top_k_forward_kl`), mass-covering;
- ``reverse``: KL(π_θ ‖ π_t) on both models' top k plus a rest bucket (:func:`recorded_reverse_kl`), the per-prefix
  loss of on-policy distillation and of trust-region behaviour blending, mode-seeking, from the records alone. It
  cannot see how θ spreads its mass inside the rest bucket, and a student far from its teacher can grow its entropy
  there unchecked (docs/distillation.md measures it);
- ``reverse_full``: the same KL over the whole vocabulary, the teacher's rows from a forward of the teacher in the
  trainer (one teacher forward per sample; the records' dense values go unused)."""

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


def _at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32, or as it is if wider (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate at both ends (−inf at x = 0). For recorded values, which carry no
    gradient: at x = 0 its derivative is infinite."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _student_log_rest(logp_student: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """log of the student's mass outside ``ids`` per row, ``[n]``, summed over those tokens themselves.

    ``logp_student`` ``[n, V]`` log-probabilities; ``ids`` ``[n, m]`` with ``valid`` ``[n, m]`` marking the real ones.
    Not log(1 − Σ recorded): that cancels catastrophically when the recorded tokens hold nearly all the mass, and in
    float32 or float64 it can round to 0 or below in whatever order a CPU's reduction adds (a NaN gradient). A
    logsumexp over the complement has no cancellation, is −inf exactly where the complement is empty (the ids cover the
    row) or holds no mass, and there its gradient is 0, not 0·∞.
    """
    vocab = logp_student.shape[-1]
    # Padding goes to an extra column, so every write is True and duplicates cannot race.
    column = torch.where(valid, ids, vocab).long()
    recorded = torch.zeros(logp_student.shape[0], vocab + 1, dtype=torch.bool, device=logp_student.device).scatter_(
        -1, column, True
    )[:, :vocab]
    outside = logp_student.masked_fill(recorded, -math.inf)
    empty = ~(outside > -math.inf).any(-1)
    # A row with nothing outside is replaced by zeros before the logsumexp (whose gradient there would be 0/0) and
    # its result by −inf after it, so no NaN reaches the backward pass through the branch torch.where discards.
    safe = torch.where(empty.unsqueeze(-1), torch.zeros_like(outside), outside)
    return torch.where(empty, -math.inf, torch.logsumexp(safe, -1))


def _rest_term(log_p: Tensor, log_r: Tensor) -> Tensor:
    """p·(log p − log r) with p = exp(``log_p``): the rest bucket's share of a KL, 0 where ``log_p`` is −inf (an empty
    bucket), with a zero gradient there. ``log_r`` must be finite."""
    has = log_p > -math.inf
    safe = torch.where(has, log_p, torch.zeros_like(log_p))
    return torch.where(has, safe.exp() * (safe - log_r), torch.zeros_like(log_p))


def top_k_forward_kl(student_logits: Tensor, top_ids: Tensor, top_logp: Tensor) -> Tensor:
    """KL(π_t ‖ π_θ) per position on the teacher's top k tokens plus one bucket for the rest of the vocabulary.

    ``student_logits`` ``[n, V]`` (any dtype; computed in float32 or wider), ``top_ids`` ``[n, k]`` and ``top_logp``
    ``[n, k]``: the teacher's k most likely tokens and their log π_t (the records' ``dense_*[:, 0]``). Returns ``[n]``
    nats. It is the exact KL between the two distributions coarsened to {top k, rest}, so it never exceeds the full
    KL, equals it when the rest has no teacher mass, and its gradient is the full forward KL's on the top k.
    The teacher's rest is 1 − Σ of its recorded values (all a record holds); the student's is summed over the tokens
    outside the top k (:func:`_student_log_rest`) and floored at e^-80 where the teacher's rest is not empty.
    """
    logp_student = torch.log_softmax(_at_least_float32(student_logits), dim=-1)
    at_top = logp_student.gather(-1, top_ids.long())
    teacher = top_logp.to(at_top.dtype)
    kl = (teacher.exp() * (teacher - at_top)).sum(-1)
    teacher_rest = _log1mexp(torch.logsumexp(teacher, -1).clamp(max=0.0))
    valid = torch.ones_like(top_ids, dtype=torch.bool)
    student_rest = _student_log_rest(logp_student, top_ids, valid).clamp(min=_LOG_REST_FLOOR)
    return kl + _rest_term(teacher_rest, student_rest)


def recorded_reverse_kl(student_logits: Tensor, ids: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(π_θ ‖ π_t) per position over the recorded tokens plus one bucket for the rest of the vocabulary: the
    per-prefix loss of on-policy distillation, from what a sample records of the teacher.

    ``student_logits`` ``[n, V]`` (any dtype; computed in float32 or wider); ``ids`` ``[n, m]``: the recorded tokens of
    each position, distinct, −1 as padding (both models' top k: where π_θ has its mass, which is what this KL weighs);
    ``teacher_logp`` ``[n, m]``: log π_t at them (ignored at padding). Returns ``[n]`` nats.

    It is the exact KL between the two distributions coarsened to {recorded tokens, rest}: never above the full KL
    (data processing), equal to it when the rest holds none of the student's mass, and its gradient is the full
    reverse KL's on the recorded tokens. The student's rest is summed over the tokens outside the ids
    (:func:`_student_log_rest`), so where the ids hold all its mass the bucket is exactly empty, with a zero gradient,
    in any summation order. Where the teacher's rest is empty but the student's is not, the teacher's is floored at
    e^-80 (a large, finite loss, not inf).
    """
    if ids.shape != teacher_logp.shape or ids.dim() != 2 or ids.shape[0] != student_logits.shape[0]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and teacher_logp {tuple(teacher_logp.shape)} must both be [n, m] with n = "
            f"{student_logits.shape[0]} rows of student_logits"
        )
    valid = ids >= 0
    ordered = torch.sort(torch.where(valid, ids, -1 - torch.arange(ids.shape[1], device=ids.device)), -1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ValueError("ids must be distinct within a row (a token recorded twice would count twice)")
    logp_student = torch.log_softmax(_at_least_float32(student_logits), dim=-1)
    at = logp_student.gather(-1, ids.clamp(min=0).long())
    teacher = teacher_logp.to(at.dtype)
    # Padding contributes nothing: its term is 0 and the teacher's value there is never read.
    term = torch.where(valid, at.exp() * (at - torch.where(valid, teacher, torch.zeros_like(teacher))), 0.0)
    student_rest = _student_log_rest(logp_student, ids, valid)
    teacher_rest = _log1mexp(
        torch.logsumexp(torch.where(valid, teacher, torch.full_like(teacher, -math.inf)), -1).clamp(max=0.0)
    ).clamp(min=_LOG_REST_FLOOR)
    return term.sum(-1) + _rest_term(student_rest, teacher_rest)


def recorded_teacher_logp(dense_ids: Tensor, dense_logp: Tensor, dense_other_logp: Tensor) -> tuple[Tensor, Tensor]:
    """The recorded tokens of each position and log π_t at them, as :func:`recorded_reverse_kl` reads them.

    Takes a sample's dense records (``[n, 2, k]`` each: role 0 the teacher's top k with log π_t and log π_θ, role 1
    theta's with log π_θ and log π_t; :class:`dual_sampling.records.SampleRecord`). Returns (ids ``[n, 2k]`` int64,
    log π_t ``[n, 2k]``): the teacher's top k, then theta's, a token in both kept once (its theta copy is −1).
    """
    teacher_ids, theta_ids = dense_ids[:, 0].long(), dense_ids[:, 1].long()
    again = (theta_ids.unsqueeze(-1) == teacher_ids.unsqueeze(-2)).any(-1)
    ids = torch.cat([teacher_ids, torch.where(again, -1, theta_ids)], -1)
    return ids, torch.cat([dense_logp[:, 0], dense_other_logp[:, 1]], -1)
