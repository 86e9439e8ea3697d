"""A batched active-set Newton solver: minimise a log-partition over the teachers' weights.

For K teachers and θ, with d_i = log π_i − log π_θ on a joint support S, the geometric
family's log-normaliser in the teacher weights a ∈ R^K is

    f(a) = log Σ_{y∈S} exp(log π_θ(y) + Σ_i a_i·d_i(y)),

convex, with gradient m = E_{q_a}[d] and Hessian C = Cov_{q_a}(d) (one pass over the
vocabulary gives f, m and C together). It is minimised over the polytope

    P = {a : a_i ≥ 0 for every i, lo ≤ Σ_i a_i ≤ hi},

the teachers' total weight clamped as one α is for one teacher (docs/theory.md derives why
this is the K-teacher kl_symmetry point).

Method (a primal active-set method, one row per batch entry, K small):

- A *working set* per row holds the bounds treated as equalities: a_i = 0 for some i, and
  at most one of Σa = hi or Σa = lo.
- On that face, the Newton step δ solves the equality-constrained quadratic model
  [C + ρI, 1; 1ᵀ, 0]·[δ; ν] = [−m; 0], with δ_i = 0 on fixed teachers and the last row only
  when the sum is fixed; ρ is a tiny ridge, so two teachers whose d coincide on S (a
  singular C) still give a step.
- The step is cut at the first bound it crosses, then backtracked (Armijo on f) until f
  falls; a bound it stops at joins the working set. Each trial point is one pass.
- When the step is negligible the face is solved, and its Lagrange multipliers decide:
  λ_i = m_i + ν ≥ 0 for each fixed teacher, ν ≥ 0 at Σa = hi, ν ≤ 0 at Σa = lo. If all
  hold, the row is at the KKT point of a convex problem, hence a global minimum; otherwise
  the most violated bound leaves the working set and the row goes on.

f falls strictly at every accepted step, so no face repeats with a higher f and the method
ends after finitely many faces; within a face Newton converges quadratically. Rows stop when
the face's step is shorter than ``xtol`` (in weight) or its projected gradient is at most
``tol``, and no multiplier is below −``tol``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["minimize_log_partition"]

_ARMIJO = 1e-4
_MAX_HALVINGS = 40


def _moments(base: Tensor, diffs: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(f ``[b]``, m ``[b, K]``, C ``[b, K, K]``) at weights ``a`` ``[b, K]``; ``diffs`` is ``[b, K, V]``."""
    # Batched matrix products, each one read of the K rows (an einsum of three can form a [b, K, K, V] temporary).
    work = torch.bmm(a.unsqueeze(1), diffs).squeeze(1).add_(base)
    top = work.amax(dim=-1, keepdim=True)
    weights = work.sub_(top).exp_()
    total = weights.sum(-1, keepdim=True)
    weights /= total
    mean = torch.bmm(diffs, weights.unsqueeze(-1)).squeeze(-1)
    # Centred before the product: E[d·dᵀ] − m·mᵀ cancels to noise where q sits on one token.
    centred = diffs - mean.unsqueeze(-1)
    cov = torch.bmm(centred * weights.unsqueeze(1), centred.transpose(1, 2))
    return top.squeeze(-1) + torch.log(total.squeeze(-1)), mean, cov


def _face_step(mean: Tensor, cov: Tensor, fixed: Tensor, sum_fixed: Tensor) -> tuple[Tensor, Tensor]:
    """Newton step δ ``[b, K]`` on each row's face and the sum's multiplier ν ``[b]``."""
    b, k = mean.shape
    free = ~fixed
    scale = torch.diagonal(cov, dim1=-2, dim2=-1).abs().amax(-1).clamp_min(1e-12)
    ridge = 1e-9 if cov.dtype == torch.float64 else 1e-5
    system = torch.zeros(b, k + 1, k + 1, dtype=cov.dtype, device=cov.device)
    both = free.unsqueeze(-1) & free.unsqueeze(-2)
    system[:, :k, :k] = torch.where(both, cov, torch.zeros_like(cov))
    eye = torch.eye(k, dtype=cov.dtype, device=cov.device)
    # Free teachers get the ridge; fixed ones get the identity row and column (δ_i = 0).
    system[:, :k, :k] += eye * torch.where(free, ridge * scale.unsqueeze(-1), torch.ones_like(mean)).unsqueeze(-1)
    ones = (free & sum_fixed.unsqueeze(-1)).to(cov.dtype)
    system[:, :k, k] = ones
    system[:, k, :k] = ones
    system[:, k, k] = torch.where(sum_fixed, 0.0, 1.0).to(cov.dtype)
    rhs = torch.cat([torch.where(free, -mean, torch.zeros_like(mean)), torch.zeros_like(mean[:, :1])], dim=-1)
    solution = torch.linalg.solve(system, rhs)
    return solution[:, :k], solution[:, k]


def _face_gradient(mean: Tensor, fixed: Tensor, sum_fixed: Tensor) -> Tensor:
    """The gradient projected on each row's face, ``[b, K]``: free teachers' m, less their mean if Σa is fixed."""
    free = ~fixed
    count = free.sum(-1, keepdim=True).clamp_min(1)
    centre = torch.where(free, mean, torch.zeros_like(mean)).sum(-1, keepdim=True) / count
    projected = mean - torch.where(sum_fixed.unsqueeze(-1), centre, torch.zeros_like(centre))
    return torch.where(free, projected, torch.zeros_like(mean))


def minimize_log_partition(
    base: Tensor,
    diffs: Tensor,
    start: Tensor,
    lo: float,
    hi: float,
    tol: float,
    xtol: float,
    max_passes: int = 200,
) -> tuple[Tensor, int]:
    """Minimise f over P for every row; return (weights ``[B, K]``, passes made).

    ``base`` is log π_θ ``[B, V]`` (−inf off the support), ``diffs`` the d_i ``[B, K, V]``
    (finite; 0 off the support), ``start`` a point ``[B, K]`` with non-negative entries (it is
    moved into P by scaling its sum).
    """
    batch, k = start.shape
    if batch == 0 or hi == 0.0:
        return torch.zeros_like(start), 0
    a = start.clamp_min(0.0)
    total = a.sum(-1, keepdim=True)
    target = total.clamp(lo, hi)
    # Scale into P; an all-zero start that must grow takes equal shares.
    a = torch.where(total > 0, a * target / torch.where(total > 0, total, 1.0), target / k)
    fixed = a <= 0.0
    eps = torch.finfo(a.dtype).eps
    # lo == hi holds the sum for good; otherwise a start on a bound of the sum holds it until released.
    sum_at_hi = (a.sum(-1) >= hi * (1 - 4 * eps)) | (lo == hi)
    sum_at_lo = (a.sum(-1) <= lo * (1 + 4 * eps)) & (lo > 0.0) & ~sum_at_hi
    active = torch.ones(batch, dtype=torch.bool, device=a.device)
    f, mean, cov = _moments(base, diffs, a)
    passes = 1
    while True:
        rows = active.nonzero().flatten()
        if rows.numel() == 0:
            break
        if passes >= max_passes:
            raise RuntimeError(f"alpha solver did not converge in {max_passes} passes (rows {rows.tolist()})")
        ra, rf, rmean, rcov = a[rows], f[rows], mean[rows], cov[rows]
        rfixed, rhi, rlo = fixed[rows], sum_at_hi[rows], sum_at_lo[rows]
        # f's rounding, and the gradient's: below them no step can be told from noise.
        noise = 8 * eps * (1.0 + rf.abs())
        gtol = tol + 16 * eps * (1.0 + rmean.abs().amax(-1))
        # Solve each row's face; release bounds whose multipliers are wrong until a step moves or the row is done.
        done = torch.zeros_like(rows, dtype=torch.bool)
        for _ in range(k + 2):
            sum_fixed = rhi | rlo
            step, nu = _face_step(rmean, rcov, rfixed, sum_fixed)
            nu = torch.where(sum_fixed, nu, torch.zeros_like(nu))
            gradient = _face_gradient(rmean, rfixed, sum_fixed)
            # On the face exactly (the solve leaves Σδ off zero by its rounding, which m ≈ ν·1 would multiply), and
            # slopes from the face's gradient, not m: along the face they are equal, and only the first is accurate.
            step = _face_gradient(step, rfixed, sum_fixed)
            # A Newton step that is not a descent direction (a near-singular C) gives way to the projected gradient.
            uphill = ~((gradient * step).sum(-1) < 0) | ~torch.isfinite(step).all(-1)
            step = torch.where(uphill.unsqueeze(-1), -gradient, step)
            slope = (gradient * step).sum(-1)
            still = (step.abs().amax(-1) <= xtol) | (gradient.abs().amax(-1) <= gtol)
            lam = torch.where(rfixed, rmean + nu.unsqueeze(-1), torch.full_like(rmean, math.inf))
            worst_teacher = lam.min(-1)
            sum_violation = torch.where(rhi & (lo != hi), -nu, torch.where(rlo, nu, torch.full_like(nu, -math.inf)))
            teacher_violation = -worst_teacher.values
            violated = still & (torch.maximum(teacher_violation, sum_violation) > gtol)
            done |= still & ~violated
            if not bool(violated.any()):
                break
            release_sum = violated & (sum_violation >= teacher_violation)
            release_teacher = violated & ~release_sum
            rhi = rhi & ~release_sum
            rlo = rlo & ~release_sum
            released = torch.nn.functional.one_hot(worst_teacher.indices, k).bool() & release_teacher.unsqueeze(-1)
            rfixed = rfixed & ~released
        fixed[rows], sum_at_hi[rows], sum_at_lo[rows] = rfixed, rhi, rlo
        moving = ~done
        # The longest step along δ that stays in P: cut at the first teacher reaching 0 or the sum reaching a bound.
        falling = (step < 0) & ~rfixed
        limit = torch.where(falling, ra / torch.where(falling, -step, 1.0), math.inf)
        t_max, blocker = limit.min(-1)
        rise = torch.where(sum_fixed, 0.0, step.sum(-1))  # a held sum moves by rounding only
        room_hi = torch.where(rise > 0, (hi - ra.sum(-1)) / torch.where(rise > 0, rise, 1.0), math.inf)
        room_lo = torch.where(rise < 0, (ra.sum(-1) - lo) / torch.where(rise < 0, -rise, 1.0), math.inf)
        room_hi, room_lo = room_hi.clamp_min(0.0), room_lo.clamp_min(0.0)
        t = torch.minimum(torch.minimum(t_max, torch.minimum(room_hi, room_lo)), torch.ones_like(t_max))
        current = _face_gradient(rmean, rfixed, sum_fixed).abs().amax(-1)
        pending = moving.clone()
        stuck = torch.zeros_like(moving)
        accepted = torch.zeros_like(moving)
        new_f, new_mean, new_cov = rf.clone(), rmean.clone(), rcov.clone()
        for _ in range(_MAX_HALVINGS):
            sel = pending.nonzero().flatten()
            if sel.numel() == 0 or passes >= max_passes:
                break
            trial = (ra[sel] + t[sel].unsqueeze(-1) * step[sel]).clamp_min(0.0)
            if sel.numel() == batch:  # every row: no copy of the rows
                tf, tm, tc = _moments(base, diffs, trial)
            else:
                tf, tm, tc = _moments(base[rows[sel]], diffs[rows[sel]], trial)
            passes += 1
            # Near the optimum f moves less than its rounding: there a step that shrinks the face's gradient counts,
            # and one that does not ends the search (the row is at the precision's floor, judged below).
            within = tf <= rf[sel] + noise[sel]
            trial_gradient = _face_gradient(tm, rfixed[sel], sum_fixed[sel])
            shrinks = trial_gradient.abs().amax(-1) < current[sel]
            # f is convex, so a trial where the derivative along δ is still ≤ 0 lies below the start: that test reads
            # gradients, which stay accurate where f's differences are lost in its rounding.
            descending = (trial_gradient * step[sel]).sum(-1) <= 0
            ok = (tf <= rf[sel] + _ARMIJO * t[sel] * slope[sel]) | descending | (within & shrinks)
            stuck[sel[~ok & ((tf - rf[sel]).abs() <= noise[sel])]] = True
            pending[sel[~ok]] &= ~stuck[sel[~ok]]
            good = sel[ok]
            new_f[good], new_mean[good], new_cov[good] = tf[ok], tm[ok], tc[ok]
            accepted[good] = True
            pending[good] = False
            t[sel[~ok]] *= 0.5
        # A row no step lowers: at the precision's floor if its gradient is near it, else a failure, named.
        failed = pending | stuck
        # The floor: the gradient within a few roundings, or the step's first-order decrease within f's rounding.
        floor = failed & ((current <= 10 * gtol) | (-slope <= 4 * noise))
        if bool((failed & ~floor).any()) and passes < max_passes:
            bad = rows[failed & ~floor].tolist()
            raise RuntimeError(f"alpha solver found no descent for rows {bad} (face gradients {current.tolist()})")
        done |= floor
        full = t.unsqueeze(-1) * step
        new_a = torch.where(accepted.unsqueeze(-1), (ra + full).clamp_min(0.0), ra)
        # Bounds the accepted step stopped at join the working set, snapped exactly.
        hit_teacher = accepted & (t == t_max) & (t_max < math.inf)
        snap = torch.nn.functional.one_hot(blocker, k).bool() & hit_teacher.unsqueeze(-1)
        new_a = torch.where(snap, torch.zeros_like(new_a), new_a)
        rfixed = rfixed | snap | (accepted.unsqueeze(-1) & (new_a <= 0.0))
        hit_hi = accepted & (t == room_hi)
        hit_lo = accepted & (t == room_lo) & (lo > 0.0)
        sums = new_a.sum(-1, keepdim=True)
        fix_sum = (hit_hi | hit_lo).unsqueeze(-1) & (sums > 0)
        bound = torch.where(hit_hi, torch.full_like(sums[:, 0], hi), torch.full_like(sums[:, 0], lo)).unsqueeze(-1)
        new_a = torch.where(fix_sum, new_a * bound / torch.where(sums > 0, sums, 1.0), new_a)
        a[rows], f[rows], mean[rows], cov[rows] = new_a, new_f, new_mean, new_cov
        fixed[rows] = rfixed
        sum_at_hi[rows] = rhi | hit_hi
        sum_at_lo[rows] = (rlo | hit_lo) & ~sum_at_hi[rows]
        active[rows] = ~done
    return a, passes
