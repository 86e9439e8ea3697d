"""The geometric mixture q_α ∝ π_θ^(1−α) · π_t^α, in log space.

α is the teacher weight: α = 0 returns π_θ exactly and α = 1 returns π_t exactly,
even where the other model masks tokens. For 0 < α < 1 the mixture lives on the joint
support; a row whose supports are disjoint has no mixture and raises ValueError.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from alpha.base import _rows, check_log_prob_pair

__all__ = ["geometric_log_weights", "geometric_mix"]


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
            f"theta and teacher supports are disjoint in rows {_rows(empty)}: "
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
