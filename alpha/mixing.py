"""The geometric mixture q_α ∝ π_θ^(1−α) · π_t^α, in log space, and its K-teacher form.

α is the teacher weight: α = 0 returns π_θ exactly and α = 1 returns π_t exactly,
even where the other model masks tokens. For 0 < α < 1 the mixture lives on the joint
support; a row whose supports are disjoint has no mixture and raises ValueError.

With K teachers, q ∝ π_θ^(1−Σα_i) · Π_i π_i^α_i: a model of weight 0 takes no part (its
masks included), and the mixture lives on the joint support of the models of positive weight.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from alpha.base import check_log_prob_pair, check_log_prob_rows, row_list

__all__ = [
    "geometric_log_weights",
    "geometric_log_weights_teachers",
    "geometric_mix",
    "geometric_mix_teachers",
    "theta_weight",
]


def geometric_mix(logp_theta: Tensor, logp_teacher: Tensor, alpha: Tensor | float) -> Tensor:
    """Normalised log q_α, shape ``[B, V]`` (``[V]`` for 1-D inputs).

    ``alpha`` is a float, a 0-d tensor, or a ``[B]`` tensor of teacher weights in [0, 1].
    The inputs need not be normalised: constant offsets cancel in the renormalisation.
    """
    one_row = logp_theta.dim() == 1
    theta, teacher = check_log_prob_pair(logp_theta, logp_teacher)
    a = torch.as_tensor(alpha, dtype=theta.dtype, device=theta.device).reshape(-1)
    if a.numel() not in (1, theta.shape[0]):
        raise ValueError(
            f"alpha must be a scalar or have one entry per row ({theta.shape[0]}), got shape {tuple(a.shape)}"
        )
    if torch.isnan(a).any() or (a < 0).any() or (a > 1).any():
        raise ValueError(f"alpha must lie in [0, 1], got {a.tolist() if a.numel() <= 8 else a}")
    mixed = geometric_log_weights(theta, teacher, a.expand(theta.shape[0]))
    empty = mixed.amax(dim=-1) == -math.inf
    if empty.any():
        raise ValueError(
            f"theta and teacher supports are disjoint in rows {row_list(empty)}: "
            "the geometric mixture is undefined for 0 < alpha < 1"
        )
    logq = torch.log_softmax(mixed, dim=-1)
    return logq[0] if one_row else logq


def geometric_log_weights(logp_theta: Tensor, logp_teacher: Tensor, alpha: Tensor) -> Tensor:
    """log q_α up to a per-row constant, ``[B, V]``: no checks and no normalisation.

    For callers that validated their ``[B, V]`` inputs and ``alpha`` ``[B]`` already and
    normalise later anyway (the sampler draws from unnormalised weights). Reads nothing back off
    the CPU: there, checking the rows for −inf would make the host wait for the device, so the
    masked form (exact for any rows) is taken without the check.
    """
    a = alpha.unsqueeze(-1)
    on_host = logp_theta.device.type == "cpu"
    if on_host and bool(logp_theta.amin() > -math.inf) and bool(logp_teacher.amin() > -math.inf):
        return torch.lerp(logp_theta, logp_teacher, a)
    return _mix_with_masks(logp_theta, logp_teacher, a)


def _mix_with_masks(theta: Tensor, teacher: Tensor, a: Tensor) -> Tensor:
    # 0·(−inf) is NaN, so the end points select a model instead of weighting it by zero.
    return torch.where(a == 0, theta, torch.where(a == 1, teacher, (1 - a) * theta + a * teacher))


def geometric_mix_teachers(logp_theta: Tensor, logp_teachers: Tensor, alpha: Tensor) -> Tensor:
    """Normalised log q, shape ``[B, V]`` (``[V]`` for 1-D rows), for θ's rows and K teachers' ``[K, B, V]``.

    ``alpha`` holds the teacher weights, ``[B, K]`` or ``[K]`` (the same for every row), each in [0, 1] and
    summing to at most 1. K = 1 is :func:`geometric_mix`, to the bit.
    """
    one_row = logp_theta.dim() == 1
    theta, teachers = check_log_prob_rows(logp_theta, logp_teachers)
    count, batch = teachers.shape[0], theta.shape[0]
    a = torch.as_tensor(alpha, dtype=theta.dtype, device=theta.device)
    if a.dim() == 1 and a.numel() == count:
        a = a.expand(batch, count)
    if a.shape != (batch, count):
        raise ValueError(f"alpha must have shape [K] or [B, K] = [{batch}, {count}], got {tuple(a.shape)}")
    total = a.sum(-1)
    if torch.isnan(a).any() or (a < 0).any() or (a > 1).any() or (total > 1 + 1e-6).any():
        raise ValueError("alpha must hold weights in [0, 1] whose sum per row is at most 1")
    if count == 1:
        logq = geometric_mix(theta, teachers[0], a[:, 0])
        return logq[0] if one_row else logq
    mixed = geometric_log_weights_teachers(theta, teachers, a)
    empty = mixed.amax(dim=-1) == -math.inf
    if empty.any():
        raise ValueError(
            f"the models of positive weight share no token in rows {row_list(empty)}: "
            "the geometric mixture is undefined"
        )
    logq = torch.log_softmax(mixed, dim=-1)
    return logq[0] if one_row else logq


def geometric_log_weights_teachers(logp_theta: Tensor, logp_teachers: Tensor, alpha: Tensor) -> Tensor:
    """log q up to a per-row constant, ``[B, V]``, for θ ``[B, V]``, K teachers ``[K, B, V]`` and α ``[B, K]``: no
    checks and no normalisation (as :func:`geometric_log_weights`). A model of weight 0 takes no part, masks included
    (0·(−inf) would be NaN)."""
    total = torch.zeros_like(logp_theta)
    for weight, rows in (theta_weight(alpha), logp_theta), *zip(alpha.T, logp_teachers, strict=True):
        w = weight.unsqueeze(-1)
        total += torch.where(w > 0, w * rows, 0.0)
    return total


def theta_weight(alpha: Tensor) -> Tensor:
    """θ's weight 1 − Σα_i per row, ``[B]``, for teacher weights ``[B, K]``: exactly 0 where the teachers' total is
    within rounding of 1 (K roundings of the dtype), so that such a row does not take θ's masks into q."""
    rest = 1 - alpha.sum(-1)
    return torch.where(rest <= alpha.shape[-1] * torch.finfo(alpha.dtype).eps, torch.zeros_like(rest), rest)
