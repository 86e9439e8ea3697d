"""A batched, safeguarded Newton solver for monotone equations g(α) = 0 on [lo, hi].

Each row of the batch has its own non-decreasing function g_b(α). One call of the
caller's ``evaluate`` is one pass over the vocabulary for the rows still active; it
returns g and its slope g′ at the given α. The solver keeps a bracket per row, takes
the Newton step when it lands inside the bracket and the last step at least halved
|g|, and bisects otherwise. A step aimed past an end of [lo, hi] first tries that end
itself, so a root outside the interval (the clamp case) costs one pass, not a long
bisection towards the bound.

Rows stop when |g| ≤ tol, when a Newton step is shorter than xtol, when the bracket
is narrower than xtol, or when an end of [lo, hi] is shown to hold the clamped root.
Bisection halves the bracket, so the loop ends after at most ~log2((hi−lo)/xtol)
safeguarded passes even for hostile inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["Evaluate", "solve_monotone_root"]

Evaluate = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]
"""(alpha ``[b]``, rows ``[b]`` int64 or None for all rows) -> (g ``[b]``, g′ ``[b]``)."""


def solve_monotone_root(
    evaluate: Evaluate,
    alpha0: Tensor,
    lo: float,
    hi: float,
    tol: float,
    xtol: float,
    max_passes: int = 200,
) -> tuple[Tensor, int]:
    """Solve g_b(α) = 0 for every row b; return (α ``[B]`` clamped to [lo, hi], passes made).

    ``alpha0`` (shape ``[B]``) is the starting point, for example the previous step's α.
    """
    alpha = alpha0.clone().clamp_(lo, hi)
    batch = alpha.shape[0]
    if lo == hi or batch == 0:
        return alpha.fill_(lo), 0
    low = torch.full_like(alpha, lo)
    high = torch.full_like(alpha, hi)
    prev_abs_g = torch.full_like(alpha, float("inf"))
    lo_tried = torch.zeros(batch, dtype=torch.bool, device=alpha.device)
    hi_tried = torch.zeros_like(lo_tried)
    active = torch.ones_like(lo_tried)
    passes = 0
    while passes < max_passes:
        rows = None if bool(active.all()) else active.nonzero().flatten()
        a = alpha if rows is None else alpha[rows]
        g, slope = evaluate(a, rows)
        passes += 1

        def pick(t: Tensor, rows: Tensor | None = rows) -> Tensor:
            return t if rows is None else t[rows]

        at_lo, at_hi = a <= lo, a >= hi
        lo_b = torch.where(g > 0, pick(low), a)
        hi_b = torch.where(g > 0, a, pick(high))
        # Solved here: g is small, or an end of [lo, hi] is shown to hold the clamped root.
        solved_here = (g.abs() <= tol) | (at_lo & (g >= 0)) | (at_hi & (g <= 0))

        # Newton target; a flat slope points straight at the side that g's sign names.
        usable = (slope > 0) & torch.isfinite(slope)
        inf = torch.full_like(a, float("inf"))
        target = torch.where(
            usable, a - g / torch.where(usable, slope, torch.ones_like(slope)), torch.where(g > 0, -inf, inf)
        )
        newton_ok = usable & (target > lo_b) & (target < hi_b) & (g.abs() <= 0.5 * pick(prev_abs_g))
        nxt = torch.where(newton_ok, target, 0.5 * (lo_b + hi_b))
        # A step aimed past an untried end of [lo, hi] tries that end first.
        to_lo = (target <= lo_b) & (lo_b <= lo) & ~(pick(lo_tried) | at_lo)
        to_hi = (target >= hi_b) & (hi_b >= hi) & ~(pick(hi_tried) | at_hi)
        nxt = torch.where(to_lo, torch.full_like(a, lo), torch.where(to_hi, torch.full_like(a, hi), nxt))
        nxt = torch.where(solved_here, a, nxt)
        done = solved_here | (newton_ok & ((target - a).abs() <= xtol)) | (hi_b - lo_b <= xtol)

        if rows is None:
            alpha, low, high, prev_abs_g = nxt, lo_b, hi_b, g.abs()
            lo_tried |= at_lo
            hi_tried |= at_hi
            active &= ~done
        else:
            alpha[rows], low[rows], high[rows], prev_abs_g[rows] = nxt, lo_b, hi_b, g.abs()
            lo_tried[rows] |= at_lo
            hi_tried[rows] |= at_hi
            active[rows] = ~done
        if not bool(active.any()):
            break
    else:
        raise RuntimeError(
            f"alpha solver did not converge in {max_passes} passes (rows {active.nonzero().flatten().tolist()})"
        )
    return alpha.clamp_(lo, hi), passes
