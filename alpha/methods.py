"""The built-in alpha computers: fixed, kl_symmetry, ess_balance, trust_region and entropy.

All take validated, normalised ``[B, V]`` log-probabilities (see ``alpha.base``) and
return the teacher weight α per row. Notation: d = log π_t − log π_θ, and
q_α ∝ exp(log π_θ + α·d).

Masked tokens. The geometric mixture for 0 < α < 1 lives on the joint support
S = {y : π_θ(y) > 0 and π_t(y) > 0}; the iterative methods solve their equation on S.
Rows whose supports are disjoint have no mixture at any interior α; there the
methods return 0.5, the limit of both equations when the masked entries are lifted
to a common floor ε → 0 (the problem is then symmetric in the two models).

Several teachers (``compute_teachers``): ``fixed`` takes one weight per teacher,
``kl_symmetry`` minimises the family's log-normaliser over the teachers' weights
(``alpha.simplex``), and ``trust_region`` scales the teachers' given shares by one root.
``ess_balance`` and ``entropy`` have no K-teacher form and are refused for K > 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from alpha.base import AlphaComputer, validate_unit_interval
from alpha.registry import register_alpha_computer
from alpha.root import solve_monotone_root
from alpha.simplex import minimize_log_partition

__all__ = ["ESSBalanceAlpha", "EntropyAlpha", "FixedAlpha", "KLSymmetryAlpha", "TrustRegionAlpha"]


@register_alpha_computer("fixed")
@dataclass
class FixedAlpha(AlphaComputer):
    """A constant teacher weight for every token; with several teachers, a constant weight per teacher."""

    alpha: float | tuple[float, ...] = 0.5
    """The teacher weight, in [0, 1], clamped to [alpha_min, alpha_max]. With K teachers, a list of K weights in
    [0, 1] whose sum is at most 1 (the total is clamped, the shares kept)."""

    several_teachers: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.alpha, (list, tuple)):
            weights = tuple(validate_unit_interval(f"alpha[{i}]", value) for i, value in enumerate(self.alpha))
            if not weights or sum(weights) > 1.0 + 1e-12:
                raise ValueError(f"alpha must list one weight per teacher, summing to at most 1, got {list(weights)}")
            self.alpha = weights[0] if len(weights) == 1 else weights
        else:
            self.alpha = validate_unit_interval("alpha", self.alpha)

    def check_teacher_count(self, teachers: int) -> None:
        super().check_teacher_count(teachers)
        listed = len(self.alpha) if isinstance(self.alpha, tuple) else 1
        if listed != teachers:
            raise ValueError(
                f"alpha must list one weight per teacher ({teachers}), got {self.alpha!r}"
                + (" (a list of one weight per teacher)" if teachers > 1 else "")
            )

    def solve(self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None) -> tuple[Tensor, int]:
        self.check_teacher_count(1)
        return torch.full(logp_theta.shape[:1], self.alpha, dtype=logp_theta.dtype, device=logp_theta.device), 0

    def for_teachers(self, present: Sequence[int]) -> FixedAlpha:
        weights = self.alpha if isinstance(self.alpha, tuple) else (self.alpha,)
        chosen = tuple(weights[i] for i in present)
        return dataclasses.replace(self, alpha=chosen[0] if len(chosen) == 1 else chosen)

    def solve_teachers(
        self, logp_theta: Tensor, logp_teachers: Tensor, alpha_init: Tensor | None
    ) -> tuple[Tensor, int]:
        weights = torch.tensor(self.alpha, dtype=logp_theta.dtype, device=logp_theta.device)
        return weights.expand(logp_theta.shape[0], -1).clone(), 0


@dataclass
class _MonotoneRootAlpha(AlphaComputer):
    """Shared machinery of the methods that solve a monotone equation in α on the joint support."""

    tol: float | None = None
    """Stop when the equation's residual is at most this; None picks 1e-10 (float64) or 1e-6 (float32)."""
    xtol: float | None = None
    """Stop when a Newton step or the bracket is shorter than this, in α; None picks 1e-12 or 1e-7."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tol", "xtol"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")

    def tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        f64 = dtype == torch.float64
        tol = self.tol if self.tol is not None else (1e-10 if f64 else 1e-6)
        xtol = self.xtol if self.xtol is not None else (1e-12 if f64 else 1e-7)
        return tol, xtol

    def solve(self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None) -> tuple[Tensor, int]:
        if bool(logp_theta.amin() > -math.inf) and bool(logp_teacher.amin() > -math.inf):
            # Nothing masked (the usual case for model outputs): the joint support is everything.
            base, diff = logp_theta, logp_teacher - logp_theta
            overlap = torch.ones(logp_theta.shape[0], dtype=torch.bool, device=logp_theta.device)
        else:
            joint = torch.isfinite(logp_theta) & torch.isfinite(logp_teacher)
            # Off the joint support: base log-prob -inf (weight 0) and d = 0 (so 0·d stays 0, not NaN).
            base = torch.where(joint, logp_theta, torch.full_like(logp_theta, -math.inf))
            diff = torch.where(joint, logp_teacher - logp_theta, torch.zeros_like(logp_theta))
            overlap = joint.any(dim=-1)
        alpha = torch.full(logp_theta.shape[:1], 0.5, dtype=logp_theta.dtype, device=logp_theta.device)
        if alpha_init is not None:
            alpha = torch.where(overlap, alpha_init, alpha)
        if not bool(overlap.all()):
            keep = overlap.nonzero().flatten()
            base, diff = base[keep], diff[keep]
        else:
            keep = None

        def evaluate(a: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
            if rows is None:
                return self.residual(base, diff, a)
            return self.residual(base[rows], diff[rows], a)

        tol, xtol = self.tolerances(logp_theta.dtype)
        start = alpha if keep is None else alpha[keep]
        solved, passes = solve_monotone_root(evaluate, start, self.alpha_min, self.alpha_max, tol, xtol)
        if keep is None:
            return solved, passes
        alpha[keep] = solved
        return alpha, passes

    def residual(self, base: Tensor, diff: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        """(g(α), g′(α)) per row, g non-decreasing in α, for base = log π_θ and diff = d on S."""
        raise NotImplementedError


def _tilted_moments(base: Tensor, diff: Tensor, tilt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For r ∝ exp(base + tilt·diff) per row: (log-normaliser, E_r[diff], E_r[diff²]), each ``[b]``.

    One buffer, worked in place: shift by the row max, exponentiate once, then take the
    three sums (this is the solver's whole cost per pass).
    """
    work = torch.addcmul(base, tilt.unsqueeze(-1), diff)
    top = work.amax(dim=-1, keepdim=True)
    weights = work.sub_(top).exp_()
    total = weights.sum(-1)
    first = weights.mul_(diff).sum(-1)
    second = weights.mul_(diff).sum(-1)
    return top.squeeze(-1) + torch.log(total), first / total, second / total


@register_alpha_computer("kl_symmetry")
@dataclass
class KLSymmetryAlpha(_MonotoneRootAlpha):
    """α such that KL(q_α‖π_θ) = KL(q_α‖π_t): the root of Δ(α) = E_{q_α}[d] = 0.

    Δ is non-decreasing with Δ′(α) = Var_{q_α}(d), Δ(0) = −KL(π_θ‖π_t) ≤ 0 and
    Δ(1) = KL(π_t‖π_θ) ≥ 0, so the root exists and Newton converges in a few passes.

    With K teachers: the weights that minimise log Z(α) = log Σ π_θ·Π_i e^(α_i·d_i) over
    α_i ≥ 0 with Σα_i in [alpha_min, alpha_max], on the joint support of all K+1 models. Its
    KKT point is where E_q[log π_j] is equal for every model of positive weight (so are the
    KLs of q to them) and no smaller for a model of weight 0 (it is no farther from q); q there minimises the largest
    KL(q‖π_j) (docs/theory.md). K = 1 is the root above. Rows with no joint support take
    equal weights, 1/(K+1) each.
    """

    several_teachers: ClassVar[bool] = True

    def residual(self, base: Tensor, diff: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        _, mean, second = _tilted_moments(base, diff, alpha)
        return mean, (second - mean * mean).clamp_min(0.0)

    def solve_teachers(
        self, logp_theta: Tensor, logp_teachers: Tensor, alpha_init: Tensor | None
    ) -> tuple[Tensor, int]:
        # Solved in float64 whatever the rows' dtype: where q sits on a few tokens, float32's rounding of f and of
        # the K×K covariance leaves no usable descent (logits of spread 50: optimality gaps of nats, measured), and
        # this path is the torch reference's, not a kernel's.
        dtype = logp_theta.dtype
        logp_theta, logp_teachers = logp_theta.double(), logp_teachers.double()
        alpha_init = None if alpha_init is None else alpha_init.double()
        alpha, passes = self._solve_teachers_float64(logp_theta, logp_teachers, alpha_init)
        return alpha.to(dtype), passes

    def _solve_teachers_float64(
        self, logp_theta: Tensor, logp_teachers: Tensor, alpha_init: Tensor | None
    ) -> tuple[Tensor, int]:
        count = logp_teachers.shape[0]
        teachers = logp_teachers.transpose(0, 1)  # [B, K, V]
        diffs = teachers - logp_theta.unsqueeze(1)
        equal = torch.full((logp_theta.shape[0], count), 1.0 / (count + 1), dtype=diffs.dtype, device=diffs.device)
        start = equal if alpha_init is None else alpha_init
        tol, xtol = self.tolerances(diffs.dtype)
        if bool(logp_theta.amin() > -math.inf) and bool(logp_teachers.amin() > -math.inf):
            # Nothing masked (the usual case for model outputs): every row's joint support is the vocabulary.
            return minimize_log_partition(logp_theta, diffs, start, self.alpha_min, self.alpha_max, tol, xtol)
        joint = torch.isfinite(logp_theta) & torch.isfinite(teachers).all(dim=1)
        base = torch.where(joint, logp_theta, torch.full_like(logp_theta, -math.inf))
        diffs = torch.where(joint.unsqueeze(1), diffs, torch.zeros_like(diffs))
        keep = joint.any(dim=-1).nonzero().flatten()
        solved, passes = minimize_log_partition(
            base[keep], diffs[keep], start[keep], self.alpha_min, self.alpha_max, tol, xtol
        )
        equal[keep] = solved
        return equal, passes


@register_alpha_computer("ess_balance")
@dataclass
class ESSBalanceAlpha(_MonotoneRootAlpha):
    """α such that the importance weights of both models under q_α have equal effective sample size.

    ESS of π/q under q is 1 / Σ π²/q, so the equation is Σ π_t²/q = Σ π_θ²/q, i.e.
    g(α) = log Σ exp(log π_θ − α·d) − log Σ exp(log π_θ + (2 − α)·d) = 0. g is
    non-decreasing, with g(0) = −log Σ π_t²/π_θ ≤ 0 and g(1) = log Σ π_θ²/π_t ≥ 0: as α
    grows, q moves towards the teacher, whose weights then become the better behaved.
    """

    def residual(self, base: Tensor, diff: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        log_theta_side, mean_theta_side, _ = _tilted_moments(base, diff, -alpha)
        log_teacher_side, mean_teacher_side, _ = _tilted_moments(base, diff, 2.0 - alpha)
        return log_theta_side - log_teacher_side, mean_teacher_side - mean_theta_side


@register_alpha_computer("trust_region")
@dataclass
class TrustRegionAlpha(_MonotoneRootAlpha):
    """The largest α in [alpha_min, alpha_max] with KL(q_α‖π_θ) ≤ ``kl_budget``: as much teacher as a trust region
    of ε nats around the student allows (trust-region behaviour blending; docs/theory.md).

    With log Z(α) = log Σ_S π_θ·e^(α·d), q_α = π_θ·e^(α·d)/Z on the joint support S, so
    K(α) = KL(q_α‖π_θ) = α·E_{q_α}[d] − log Z(α), and K′(α) = α·Var_{q_α}(d) ≥ 0: K is
    non-decreasing, and {α : K(α) ≤ ε} is an interval [alpha_min, α*]. Near 0, K ≈ α²·Var/2
    is flat, so Newton runs on h(α) = √(2K) − √(2ε), which is close to linear there, with
    h′ = α·Var/√(2K) (√Var at K = 0). Clamps: a budget that α = alpha_max stays within gives
    alpha_max; one that even alpha_min exceeds (a masked row's K(0) = −log π_θ(S) can)
    gives alpha_min. K is flat only when d is constant on S (then K is constant, and the
    answer is alpha_max or alpha_min by that constant); ε = 0 gives alpha_min unless it is.

    With K teachers, the teachers keep the proportions ``teacher_shares`` p, so the mixture is
    today's with the teacher Π π_i^(p_i) (its normaliser cancels in q and K): one root gives
    the total weight s, and α_i = s·p_i.
    """

    kl_budget: float = 0.1
    """ε, in nats: the most KL(q_α‖π_θ) a row may reach; >= 0."""
    teacher_shares: tuple[float, ...] | None = None
    """With several teachers: each teacher's share of the total teacher weight, non-negative, one per teacher,
    rescaled to sum to 1; None gives equal shares."""

    several_teachers: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.kl_budget
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
            raise ValueError(f"kl_budget must be a finite number >= 0 (nats), got {value!r}")
        self.kl_budget = float(value)
        if self.teacher_shares is not None:
            shares = self.teacher_shares
            if not isinstance(shares, (list, tuple)) or not shares:
                raise ValueError(f"teacher_shares must be a list of one share per teacher, got {shares!r}")
            for i, share in enumerate(shares):
                if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 <= share < math.inf):
                    raise ValueError(f"teacher_shares[{i}] must be a finite number >= 0, got {share!r}")
            if sum(shares) <= 0:
                raise ValueError(f"teacher_shares must have a positive sum, got {list(shares)}")
            self.teacher_shares = tuple(float(share) for share in shares)

    def check_teacher_count(self, teachers: int) -> None:
        super().check_teacher_count(teachers)
        if self.teacher_shares is not None and len(self.teacher_shares) != teachers:
            raise ValueError(f"teacher_shares must list one share per teacher ({teachers}), got {self.teacher_shares}")

    def for_teachers(self, present: Sequence[int]) -> TrustRegionAlpha:
        if self.teacher_shares is None:
            return self
        chosen = tuple(self.teacher_shares[i] for i in present)
        # Present teachers of share 0 alone: the request asked for them, so they split the weight equally.
        return dataclasses.replace(self, teacher_shares=chosen if sum(chosen) > 0 else None)

    def solve_teachers(
        self, logp_theta: Tensor, logp_teachers: Tensor, alpha_init: Tensor | None
    ) -> tuple[Tensor, int]:
        count = logp_teachers.shape[0]
        shares = torch.tensor(self.teacher_shares or (1.0,) * count, dtype=logp_theta.dtype, device=logp_theta.device)
        shares = shares / shares.sum()
        # The teachers' geometric mixture at the shares; a teacher of share 0 takes no part (0·(−inf) is NaN).
        weighted = torch.where(shares.view(-1, 1, 1) > 0, shares.view(-1, 1, 1) * logp_teachers, 0.0).sum(0)
        alpha = torch.full(logp_theta.shape[:1], self.alpha_min, dtype=logp_theta.dtype, device=logp_theta.device)
        # Teachers with no token in common leave no mixture at any positive total: those rows keep alpha_min.
        mixable = (weighted > -math.inf).any(dim=-1)
        keep = mixable.nonzero().flatten()
        if keep.numel() == 0:
            return alpha.unsqueeze(-1) * shares, 0
        start = None if alpha_init is None else alpha_init[keep].sum(-1)
        total, passes = self.solve(logp_theta[keep], torch.log_softmax(weighted[keep], dim=-1), start)
        alpha[keep] = total.clamp(self.alpha_min, self.alpha_max)
        return alpha.unsqueeze(-1) * shares, passes

    def residual(self, base: Tensor, diff: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        log_z, mean, second = _tilted_moments(base, diff, alpha)
        var = (second - mean * mean).clamp_min(0.0)
        kl = (alpha * mean - log_z).clamp_min(0.0)
        eps = torch.finfo(base.dtype).eps
        flat = var <= 64 * eps * (1.0 + second)  # d constant on S: K is constant in α
        if self.kl_budget == 0.0:  # the largest α with K ≤ 0: alpha_min, unless K is flat at 0
            within = flat & (kl <= 64 * eps)
            return torch.where(within, -1.0, 1.0).to(base.dtype), torch.zeros_like(kl)
        root = torch.sqrt(2.0 * kl)
        tiny = kl <= eps
        slope = torch.where(tiny, torch.sqrt(var), alpha * var / torch.where(tiny, 1.0, root))
        h = root - math.sqrt(2.0 * self.kl_budget)
        # A flat K has no root inside: its sign alone sends the solver to the clamp it belongs to.
        h = torch.where(flat, torch.where(kl <= self.kl_budget, -1.0, 1.0).to(h.dtype), h)
        return h, torch.where(flat, torch.zeros_like(slope), slope)


@register_alpha_computer("entropy")
@dataclass
class EntropyAlpha(AlphaComputer):
    """Heuristic α = H(π_t) / (H(π_θ) + H(π_t)): the flatter (less certain) model gets more weight.

    Not the solution of any balance equation; cheap (one pass) and in the same direction as
    kl_symmetry. Two one-hot distributions (both entropies 0) give 0.5.
    """

    def solve(self, logp_theta: Tensor, logp_teacher: Tensor, alpha_init: Tensor | None) -> tuple[Tensor, int]:
        h_theta, h_teacher = _entropy(logp_theta), _entropy(logp_teacher)
        total = h_theta + h_teacher
        half = torch.full_like(total, 0.5)
        return torch.where(total > 0, h_teacher / torch.where(total > 0, total, torch.ones_like(total)), half), 1


def _entropy(logp: Tensor) -> Tensor:
    """Shannon entropy in nats per row; masked (-inf) tokens contribute 0."""
    p = torch.exp(logp)
    return (-torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)).clamp_min(0.0)
