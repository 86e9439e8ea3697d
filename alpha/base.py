"""The alpha-computer interface and the input checks every method shares.

Convention: α is always the *teacher* weight. The sampling distribution is

    q_α(y) ∝ π_θ(y)^(1−α) · π_t(y)^α,

so α = 0 gives the theta (student) model and α = 1 the teacher.

Interface
---------
An alpha computer is a dataclass whose fields are its configuration. Calling it
maps a batch of log-probability pairs to one α per row::

    ac(logp_theta: Tensor[B, V], logp_teacher: Tensor[B, V]) -> Tensor[B]

Inputs are float32 or float64 natural-log probabilities; ``-inf`` marks a masked
token. Rows need not be exactly normalised: they are renormalised first, since
every method here depends on the normalised distributions. A 1-D ``[V]`` pair is
accepted and gives a 0-d result. Results are clamped to ``[alpha_min, alpha_max]``.

``compute`` does the same and also reports how many passes over the vocabulary
the solver made, for benchmarks; ``alpha_init`` lets a caller warm-start
iterative methods from the previous step's α, and ``normalized=True`` skips the
renormalisation for callers that just took a log-softmax themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["AlphaComputer", "AlphaResult", "check_log_prob_pair", "validate_unit_interval"]


@dataclass(frozen=True)
class AlphaResult:
    """What one call of an alpha computer produced."""

    alpha: Tensor
    """Teacher weight per row, shape ``[B]`` (or 0-d for a 1-D input)."""
    passes: int
    """Passes over the vocabulary the solver made (0 for closed-form methods)."""


def validate_unit_interval(name: str, value: float) -> float:
    """Return ``value`` as a float if it is a finite number in [0, 1]; raise ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    value = float(value)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return value


def check_log_prob_pair(logp_theta: Tensor, logp_teacher: Tensor) -> tuple[Tensor, Tensor]:
    """Validate a (theta, teacher) pair of log-probability tensors and return them as 2-D, same dtype.

    Accepts shape ``[V]`` or ``[B, V]``; half-precision inputs are promoted to float32.
    Raises ValueError naming the problem for mismatched shapes, NaN, +inf, or a row
    with no finite entry (nothing could be sampled from it).
    """
    for name, x in (("logp_theta", logp_theta), ("logp_teacher", logp_teacher)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dim() not in (1, 2):
            raise ValueError(f"{name} must have shape [V] or [B, V], got {tuple(x.shape)}")
    if logp_theta.shape != logp_teacher.shape:
        raise ValueError(
            f"logp_theta and logp_teacher must have the same shape, got "
            f"{tuple(logp_theta.shape)} and {tuple(logp_teacher.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp_theta.dtype, logp_teacher.dtype), torch.float32)
    pair = []
    for name, x in (("logp_theta", logp_theta), ("logp_teacher", logp_teacher)):
        x = x.to(dtype).reshape(-1, x.shape[-1])
        # One reduction finds every bad row: the row max is NaN, +inf, or -inf (all masked).
        top = x.amax(dim=-1)
        if not bool(torch.isfinite(top).all()):
            for bad, what in (
                (torch.isnan(x).any(dim=-1), "contains NaN"),
                ((x == math.inf).any(dim=-1), "contains +inf"),
                (top == -math.inf, "has no finite entry (every token masked)"),
            ):
                if bad.any():
                    raise ValueError(f"{name} {what} in rows {_rows(bad)}")
        pair.append(x)
    return pair[0], pair[1]


def _rows(mask: Tensor, limit: int = 8) -> str:
    rows = mask.nonzero().flatten().tolist()
    shown = ", ".join(str(r) for r in rows[:limit])
    return shown + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")


@dataclass
class AlphaComputer:
    """Base class of all alpha computers; subclasses implement :meth:`solve`."""

    alpha_min: float = 0.0
    """Lower clamp on α (teacher weight), in [0, 1]."""
    alpha_max: float = 1.0
    """Upper clamp on α (teacher weight), in [alpha_min, 1]."""

    name: ClassVar[str] = ""
    """Registry name, set by :func:`alpha.register_alpha_computer`."""

    def __post_init__(self) -> None:
        self.alpha_min = validate_unit_interval("alpha_min", self.alpha_min)
        self.alpha_max = validate_unit_interval("alpha_max", self.alpha_max)
        if self.alpha_min > self.alpha_max:
            raise ValueError(
                f"alpha_min must not exceed alpha_max, got alpha_min={self.alpha_min} > alpha_max={self.alpha_max}"
            )

    def __call__(
        self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None = None, normalized: bool = False
    ) -> Tensor:
        """α per row, shape ``[B]`` (0-d for 1-D inputs); see the module docstring."""
        return self.compute(logp_theta, logp_teacher, alpha_init, normalized).alpha

    def compute(
        self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None = None, normalized: bool = False
    ) -> AlphaResult:
        """Like calling the computer, but also reports the solver's vocabulary passes.

        ``normalized=True`` promises that the rows are already log-softmax outputs and skips
        the renormalisation (two passes per input); the validity checks still run.
        """
        one_row = logp_theta.dim() == 1
        theta, teacher = check_log_prob_pair(logp_theta, logp_teacher)
        if not normalized:
            theta = torch.log_softmax(theta, dim=-1)
            teacher = torch.log_softmax(teacher, dim=-1)
        if alpha_init is not None:
            alpha_init = torch.as_tensor(alpha_init, dtype=theta.dtype, device=theta.device).reshape(-1)
            alpha_init = alpha_init.expand(theta.shape[0]).clamp(self.alpha_min, self.alpha_max)
        alpha, passes = self.solve(theta, teacher, alpha_init)
        alpha = alpha.clamp(self.alpha_min, self.alpha_max)
        return AlphaResult(alpha[0] if one_row else alpha, passes)

    def solve(self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None) -> tuple[Tensor, int]:
        """Return (α ``[B]``, vocabulary passes) for validated, normalised ``[B, V]`` inputs."""
        raise NotImplementedError
