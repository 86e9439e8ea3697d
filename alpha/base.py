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

Several teachers
----------------
With K teachers the mixture is q ∝ π_θ^(1−Σα_i) · Π_i π_i^α_i, one α per teacher::

    ac.compute_teachers(logp_theta: Tensor[B, V], logp_teachers: Tensor[K, B, V]) -> AlphaResult  # alpha [B, K]

K = 1 is the pair call above, to the bit. For K > 1, ``alpha_min`` and ``alpha_max`` clamp
the teachers' *total* weight Σα_i, and each α_i is at least 0. A method with no sound
K-teacher form keeps ``several_teachers = False`` and is refused by name
(:meth:`AlphaComputer.check_teacher_count`), which a run calls before any engine starts.

A row may leave teachers out (``absent``, ``[B, K]``: a request that names some teachers
only). An absent teacher's weight is exactly 0, and the others get what the method gives
the teachers present alone, their own settings kept (:meth:`AlphaComputer.for_teachers`:
``fixed``'s weights and ``trust_region``'s shares of those teachers): the rows are solved in
groups of one pattern of present teachers, so bounds on the total weight bind among them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

__all__ = [
    "AlphaComputer",
    "AlphaResult",
    "check_log_prob_pair",
    "check_log_prob_rows",
    "row_list",
    "validate_unit_interval",
]


@dataclass(frozen=True)
class AlphaResult:
    """What one call of an alpha computer produced."""

    alpha: Tensor
    """Teacher weight per row, shape ``[B]`` (0-d for a 1-D input); from ``compute_teachers``, ``[B, K]`` (``[K]``)."""
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
    theta, teacher = _check_log_probs([("logp_theta", logp_theta), ("logp_teacher", logp_teacher)])
    return theta, teacher


def check_log_prob_rows(logp_theta: Tensor, logp_teachers: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Validate θ's rows and K teachers' rows as :func:`check_log_prob_pair` does; return (θ ``[B, V]``, teachers
    ``[K, B, V]``), one dtype.

    ``logp_teachers`` is a ``[K, V]``/``[K, B, V]`` tensor or a sequence of K ``[V]``/``[B, V]`` tensors. Errors
    name the teacher by its index (``logp_teachers[1]``).
    """
    stacked = None
    if isinstance(logp_teachers, Tensor):
        if logp_teachers.dim() not in (2, 3):
            raise ValueError(f"logp_teachers must have shape [K, V] or [K, B, V], got {tuple(logp_teachers.shape)}")
        stacked = logp_teachers
        logp_teachers = list(logp_teachers.unbind(0))
    if len(logp_teachers) == 0:
        raise ValueError("logp_teachers must hold at least one teacher's rows")
    named = [(f"logp_teachers[{i}]", teacher) for i, teacher in enumerate(logp_teachers)]
    theta, *teachers = _check_log_probs([("logp_theta", logp_theta), *named])
    if stacked is not None and stacked.dtype == theta.dtype:  # no copy of a stacked input
        return theta, stacked.reshape(len(teachers), *theta.shape)
    return theta, torch.stack(teachers)


def _check_log_probs(named: Sequence[tuple[str, Tensor]]) -> list[Tensor]:
    """The named log-probability tensors, each checked once, as 2-D tensors of one dtype (at least float32)."""
    for name, x in named:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dim() not in (1, 2):
            raise ValueError(f"{name} must have shape [V] or [B, V], got {tuple(x.shape)}")
    first_name, first = named[0]
    for name, x in named[1:]:
        if x.shape != first.shape:
            raise ValueError(
                f"{first_name} and {name} must have the same shape, got {tuple(first.shape)} and {tuple(x.shape)}"
            )
    dtype = functools.reduce(torch.promote_types, (x.dtype for _, x in named), torch.float32)
    checked = []
    for name, x in named:
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
                    raise ValueError(f"{name} {what} in rows {row_list(bad)}")
        checked.append(x)
    return checked


def row_list(mask: Tensor, limit: int = 8) -> str:
    """The rows where ``mask`` ([B] bool) holds, as an error message names them: the first ``limit`` and a count."""
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
    several_teachers: ClassVar[bool] = False
    """Whether the method has a K-teacher form (:meth:`solve_teachers`); False refuses K > 1 by name."""

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

    def check_teacher_count(self, teachers: int) -> None:
        """Raise ValueError naming the method (or the field) if this computer cannot weight ``teachers`` teachers."""
        if isinstance(teachers, bool) or not isinstance(teachers, int) or teachers < 1:
            raise ValueError(f"the number of teachers must be an integer >= 1, got {teachers!r}")
        if teachers > 1 and not self.several_teachers:
            raise ValueError(
                f"alpha method {self.name!r} has no form for {teachers} teachers; "
                f"methods that weight several: {', '.join(several_teacher_methods())}"
            )

    def compute_teachers(
        self,
        logp_theta: Tensor,
        logp_teachers: Tensor | Sequence[Tensor],
        alpha_init: Tensor | None = None,
        normalized: bool = False,
        absent: Tensor | None = None,
    ) -> AlphaResult:
        """One α per teacher: ``alpha`` is ``[B, K]`` (``[K]`` for 1-D rows); see "Several teachers" above.

        ``alpha_init`` (``[B, K]`` or ``[K]``) warm-starts iterative methods. K = 1 returns :meth:`compute`'s α.
        ``absent`` (bool, ``[B, K]`` or ``[K]``; K > 1 only) marks the teachers a row leaves out: their weight is 0,
        their rows are never read (any values will do), and a row keeps at least one teacher.
        """
        one_row = logp_theta.dim() == 1
        if absent is not None:
            return self._compute_present(logp_theta, logp_teachers, alpha_init, normalized, absent)
        theta, teachers = check_log_prob_rows(logp_theta, logp_teachers)
        count = teachers.shape[0]
        self.check_teacher_count(count)
        if alpha_init is not None:
            alpha_init = torch.as_tensor(alpha_init, dtype=theta.dtype, device=theta.device)
            if alpha_init.shape not in ((count,), (theta.shape[0], count)):
                expected = f"[K] or [B, K] = [{theta.shape[0]}, {count}]"
                raise ValueError(f"alpha_init must have shape {expected}, got {tuple(alpha_init.shape)}")
            alpha_init = alpha_init.expand(theta.shape[0], count)
        if count == 1:
            pair = self.compute(theta, teachers[0], None if alpha_init is None else alpha_init[:, 0], normalized)
            alpha, passes = pair.alpha.unsqueeze(-1), pair.passes
        else:
            if not normalized:
                theta, teachers = torch.log_softmax(theta, dim=-1), torch.log_softmax(teachers, dim=-1)
            alpha, passes = self.solve_teachers(theta, teachers, alpha_init)
            alpha = clamp_total(alpha, self.alpha_min, self.alpha_max)
        return AlphaResult(alpha[0] if one_row else alpha, passes)

    def _compute_present(
        self,
        logp_theta: Tensor,
        logp_teachers: Tensor | Sequence[Tensor],
        alpha_init: Tensor | None,
        normalized: bool,
        absent: Tensor,
    ) -> AlphaResult:
        """:meth:`compute_teachers` for rows that leave teachers out: each group of rows of one pattern of present
        teachers solved by :meth:`for_teachers` on those teachers' rows alone (the others are never read)."""
        one_row = logp_theta.dim() == 1
        theta = logp_theta.unsqueeze(0) if one_row else logp_theta
        teachers = torch.stack(list(logp_teachers)) if not isinstance(logp_teachers, Tensor) else logp_teachers
        teachers = teachers.reshape(teachers.shape[0], theta.shape[0], -1)
        rows, count = theta.shape[0], teachers.shape[0]
        absent = torch.as_tensor(absent, dtype=torch.bool, device=theta.device)
        if count < 2 or absent.shape not in ((count,), (rows, count)):
            raise ValueError(f"absent must have shape [K] or [B, K] = [{rows}, {count}] with K > 1")
        absent = absent.expand(rows, count)
        if bool(absent.all(-1).any()):
            raise ValueError(f"absent leaves no teacher in rows {row_list(absent.all(-1))}")
        self.check_teacher_count(count)
        if alpha_init is not None:
            alpha_init = torch.as_tensor(alpha_init, dtype=theta.dtype, device=theta.device).expand(rows, count)
        alpha = torch.zeros(rows, count, dtype=theta.dtype, device=theta.device)
        passes = 0
        for pattern in torch.unique(absent, dim=0):
            group = (absent == pattern).all(-1).nonzero().flatten()
            present = (~pattern).nonzero().flatten()
            init = None if alpha_init is None else alpha_init[group][:, present]
            part = self.for_teachers(present.tolist()).compute_teachers(
                theta[group], teachers[present][:, group], init, normalized
            )
            alpha[group.unsqueeze(-1), present] = part.alpha.to(alpha.dtype)
            passes += part.passes
        return AlphaResult(alpha[0] if one_row else alpha, passes)

    def for_teachers(self, present: Sequence[int]) -> AlphaComputer:
        """This method for the teachers at positions ``present`` alone (in order), their own settings kept: itself
        for a method with no setting per teacher."""
        return self

    def solve_teachers(
        self, logp_theta: Tensor, logp_teachers: Tensor, alpha_init: Tensor | None
    ) -> tuple[Tensor, int]:
        """(α ``[B, K]``, vocabulary passes) for validated, normalised θ ``[B, V]`` and teachers ``[K, B, V]``."""
        raise NotImplementedError


def clamp_total(alpha: Tensor, low: float, high: float, absent: Tensor | None = None) -> Tensor:
    """Teacher weights ``[B, K]`` made non-negative with their total in [low, high], by scaling.

    A row of zeros that must reach ``low`` > 0 takes equal shares among its teachers not ``absent`` (``[B, K]``).
    """
    alpha = alpha.clamp_min(0.0)
    total = alpha.sum(-1, keepdim=True)
    target = total.clamp(low, high)
    scaled = alpha * (target / torch.where(total > 0, total, torch.ones_like(total)))
    present = torch.ones_like(alpha) if absent is None else (~absent).to(alpha.dtype)
    return torch.where(total > 0, scaled, target * present / present.sum(-1, keepdim=True))


def several_teacher_methods() -> list[str]:
    """Sorted names of the registered methods (every named subclass) that weight more than one teacher, read off the
    class tree: the registry imports this module, not the reverse."""
    classes, known = [AlphaComputer], set()
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if cls.name and cls.several_teachers:
            known.add(cls.name)
    return sorted(known)
