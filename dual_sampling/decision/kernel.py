"""The per-token decision as one compiled kernel (CPU), for the rows that need no filter.

:func:`dual_sampling.decision.pipeline.decide` is the reference: a sequence of torch operations,
each a pass over ``[b, V]`` that writes a new ``[b, V]`` tensor. For the common row
(temperature 1, no top-k/top-p/min-p, no support constraint, no logit bias, no top
log-probabilities; the stop-token mask before ``min_tokens`` and the penalties are allowed) and the ``fixed``
and ``kl_symmetry`` alpha computers, this module does the same decision with numba, row by
row, writing nothing V-sized:

1. one pass for the row maxima of both sides (on the float bits as integers, which
   vectorises and finds NaN and ±inf at the same time) and the teacher's log-normaliser
   (and theta's, unless its rows are log-softmax outputs already), chunk by chunk;
2. each α evaluation is one pass: it exponentiates the mixture's log-weights once and
   sums the weights, weight·d and weight·d² (d = log π_t − log π_θ; the first evaluation
   also weight·d³ and weight·d⁴), keeping the weight sum of every 256-token block;
3. the row's edited tokens (a sparse, sorted list: the stop tokens masked before min_tokens, weight 0, and the
   tokens a penalty touches, whose weight the penalised mixture logit gives) change q after α is solved, as in
   the reference. A block's sum takes its edited tokens' change where they held at most half of it; a block
   where they held more is summed again in float64 with the edited weights (a subtraction would cancel there).
   So the total keeps float32's resolution of the untouched tokens' mass even where the edited tokens held nearly
   all of q;
4. the draw reuses the block sums: it finds the block by a cumulative sum over blocks, then
   recomputes that one block's weights.

Differences from the reference:

- the α solve stops at the last α it evaluated (the reference steps once more, by less than
  ``xtol``, so the draw can reuse that pass);
- it stops on |E_q[d]| ≤ ``tol`` · Var_q(d), where the reference stops on
  |E_q[d]| ≤ ``tol``. The α error a residual implies is |E_q[d]| / Var_q(d), so this rule
  keeps α within ``tol`` of the root. The reference's rule leaves α off by up to
  ``tol`` / Var_q(d) when the two models nearly agree (small Var_q(d)), and asks for more
  than ``tol`` when Var_q(d) > 1, which costs a pass on most warm-started rows;
- the step from the warm start uses E_q[d]'s first four cumulants, not only the first two
  (Newton's step), so a start 0.02 off the root settles on the second pass, not the third;
- d is formed from differences of nearby values (each side shifted by its own maximum),
  not from the raw logits, so its rounding stays small when the logits are large;
- ``exp`` is a float32 polynomial with a relative error below 2e-7 (libm's is not
  vectorised by numba); weights are summed in float32 within a 256-token block and in
  float64 across blocks.

On rows where the models nearly agree this makes the kernel's α closer to a float64 solve
than the reference's (``tests/test_decision_kernel.py``). A row the kernel cannot handle (a non-finite
entry, mixture weights that all underflow, or an α solve that did not converge in ``_MAX_PASSES``
evaluations, where the reference's solver raises) is reported back and decided by the reference.

Its GPU twin is :mod:`dual_sampling.decision.gpu_kernel`; :mod:`dual_sampling.decision.fusable` says which
rows either takes.

One module over 500 lines: the kernel's passes are one compiled algorithm, tuned and
checked together (``tests/test_decision_kernel.py``); most of the length is its derivation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from alpha import AlphaComputer, FixedAlpha, KLSymmetryAlpha
from dual_sampling.decision.edits import RowEdits, row_edits
from dual_sampling.decision.fusable import KERNEL_ALPHA_METHODS
from dual_sampling.decision.rows import ModelRows

__all__ = ["decide_fused", "warm_up"]

_BLOCK = 256
_CHUNK = 2048  # tokens per step of the maxima and log-normaliser pass: both rows' chunks stay in L1
_ROW_OK, _ROW_FALLBACK = 0, 1
_MAX_PASSES = 200
"""α evaluations a row may take, as the reference's solver allows; read at each call (an argument of the compiled
kernel, not a constant compiled into it)."""
_TINY = 1e-30
_HUGE = 1e300
"""A total past it overflowed. Finiteness is tested by comparison: under the kernel's fastmath flags numba's
``math.isfinite`` of an infinite total came out true (a penalty's overflow was drawn from, and log q was -inf)."""
# Reassociation lets sums and extremes vectorise; no "nnan"/"ninf", so the finiteness checks stay.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
_jit = numba.njit(fastmath=_FAST, cache=True, nogil=True)
_jit_inline = numba.njit(fastmath=_FAST, cache=True, nogil=True, inline="always")


@intrinsic
def _float32_from_bits(typingctx, bits):
    """Reinterpret an int32 as the float32 with the same bits (vectorises, unlike 2.0**n)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _floor32(typingctx, x):
    """floor of a float32, as a float32 (``math.floor`` gives an int64, which would promote the exp to float64)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.call(builder.module.declare_intrinsic("llvm.floor", [ir.FloatType()]), args)

    return sig, codegen


@_jit_inline
def _exp32(x):
    """exp(x) for a float32 x ≤ 0, in float32 (2^n times a degree-7 polynomial on [−ln2/2, ln2/2]); 0 below −87."""
    x = max(x, np.float32(-87.0))
    n = _floor32(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    scale = _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if x <= np.float32(-87.0) else p * scale


@_jit
def _max_if_finite(row):
    """(max, whether every entry is finite) of a float32 row.

    Works on the bits as int32 so that both reductions vectorise (numba's float max does not):
    flipping a negative float's magnitude bits makes signed-int order equal float order, and
    an entry is NaN or ±inf exactly when its magnitude bits are those of inf or above.
    """
    bits = row.view(np.int32)
    top = np.int32(-2147483648)
    worst = np.int32(0)
    for i in range(bits.size):
        b = bits[i]
        # numba widens int32 arithmetic to int64; narrowing keeps the vectors 16 wide.
        key = np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))
        top = key if key > top else top
        magnitude = np.int32(b & np.int32(0x7FFFFFFF))
        worst = magnitude if magnitude > worst else worst
    top = top ^ ((top >> np.int32(31)) & np.int32(0x7FFFFFFF))
    return _float32_from_bits(top), worst < np.int32(0x7F800000)


@_jit_inline
def _exp_sum(row, shift):
    """Σ exp(row − shift) of a short float32 row (a chunk), summed in float32; entries ≤ shift."""
    total = np.float32(0.0)
    for i in range(row.size):
        total += _exp32(row[i] - shift)
    return total


@_jit
def _maxima_and_log_normalisers(teacher, theta, theta_normalized):
    """(max t, max h, log Σ exp(t), log Σ exp(h), every entry finite) of two rows, in one read of each.

    Chunk by chunk (``_CHUNK`` tokens, in cache while both are done): the chunk's maxima, then
    the exponentials relative to the largest value seen so far; when a chunk raises it, the
    sum so far is scaled down to the new one. log Σ exp(h) is 0 when ``theta_normalized``.
    """
    n = teacher.size
    t_top = h_top = np.float32(-np.inf)
    t_sum = h_sum = 0.0
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        t_chunk, t_finite = _max_if_finite(teacher[start:stop])
        h_chunk, h_finite = _max_if_finite(theta[start:stop])
        if not (t_finite and h_finite):
            return t_top, h_top, 0.0, 0.0, False
        if t_chunk > t_top:
            t_sum = t_sum * math.exp(float(t_top) - float(t_chunk)) if t_sum > 0.0 else 0.0
            t_top = t_chunk
        t_sum += _exp_sum(teacher[start:stop], t_top)
        if h_chunk > h_top:
            h_sum = h_sum * math.exp(float(h_top) - float(h_chunk)) if h_sum > 0.0 else 0.0
            h_top = h_chunk
        if not theta_normalized:
            h_sum += _exp_sum(theta[start:stop], h_top)
    lse_h = 0.0 if theta_normalized else float(h_top) + math.log(h_sum)
    return t_top, h_top, float(t_top) + math.log(t_sum), lse_h, n > 0


@_jit_inline
def _log_weight_and_diff(h, t, h_max, t_max, a):
    """(the mixture's log-weight (1 − α)(h − max h) + α(t − max t), (t − max t) − (h − max h)) in float32.

    The log-weight is ≤ 0 at the row maxima. Every weight of the kernel (the α passes, the
    masked tokens, the draw, the drawn token's log q) is made here, so block sums and the draw
    agree to the bit.
    """
    hs = h - h_max
    diff = (t - t_max) - hs
    return hs + a * diff, diff


@_jit_inline
def _log_weight(h, t, h_max, t_max, a):
    """The first half of :func:`_log_weight_and_diff`."""
    return _log_weight_and_diff(h, t, h_max, t_max, a)[0]


@_jit_inline
def _weight_and_d(h, t, hm, tm, a, cc):
    """(w, d + ``c``'s float32 remainder) of one token, in float32; see :func:`_log_weight_and_diff`."""
    log_w, diff = _log_weight_and_diff(h, t, hm, tm, a)
    return _exp32(log_w), diff - cc


@_jit_inline
def _tail_sums(theta, teacher, start, hm, tm, a, cc):
    """(Σw, Σw·dc, Σw·dc², Σw·dc³, Σw·dc⁴) over the tokens from ``start`` on (the last, partial block)."""
    z0 = np.float32(0.0)
    s1 = s2 = s3 = s4 = 0.0
    for i in range(start, theta.size):
        w, dc32 = _weight_and_d(theta[i], teacher[i], hm, tm, a, cc)
        dc = np.float64(dc32)
        z0 += w
        s1 += w * dc
        s2 += w * dc**2
        s3 += w * dc**3
        s4 += w * dc**4
    return z0, s1, s2, s3, s4


@_jit_inline
def _cumulants(c, cc, s0, s1, s2, s3, s4):
    """(Σw, E[d], κ2, κ3, κ4) from the sums Σw·dc^k, where d = dc − (c − cc); κ2–κ4 do not depend on that shift."""
    if not s0 > 0.0:
        return s0, 0.0, 0.0, 0.0, 0.0
    m1, m2, m3, m4 = s1 / s0, s2 / s0, s3 / s0, s4 / s0
    k2 = m2 - m1 * m1
    k3 = m3 - 3.0 * m1 * m2 + 2.0 * m1**3
    k4 = m4 - 4.0 * m1 * m3 - 3.0 * m2 * m2 + 12.0 * m1 * m1 * m2 - 6.0 * m1**4
    return s0, m1 - (c - float(cc)), k2, k3, k4


@_jit
def _tilted_pass(theta, teacher, alpha, h_max, t_max, c, blocks):
    """One evaluation at α: weights w = exp(log-weight), d = log π_t − log π_θ.

    Returns (Σw, E[d], Var_q(d), 0, 0) in float64, the residual and its slope in α (the zeros
    stand for the cumulants :func:`_tilted_pass_with_series` adds), and stores each block's Σw
    in ``blocks``. ``c`` is (lse_t − max t) − (lse_h − max h), so
    d = (t − max t) − (h − max h) − c: every term is a difference of nearby values, which
    keeps d's rounding far below float32's resolution of the raw logits. ``c`` enters the
    float32 loop rounded; its remainder is taken off E[d] in float64.
    """
    n = theta.size
    full = n - n % _BLOCK
    a, hm, tm, cc = np.float32(alpha), np.float32(h_max), np.float32(t_max), np.float32(c)
    s0 = s1 = s2 = 0.0  # Σw·dc^k, with dc = d + the remainder of c
    for k in range(full // _BLOCK):
        z0 = z1 = z2 = np.float32(0.0)
        for i in range(k * _BLOCK, (k + 1) * _BLOCK):
            w, dc = _weight_and_d(theta[i], teacher[i], hm, tm, a, cc)
            wd = w * dc
            z0 += w
            z1 += wd
            z2 += wd * dc
        blocks[k] = z0
        s0 += z0
        s1 += z1
        s2 += z2
    if full < n:
        z0, t1, t2, _, _ = _tail_sums(theta, teacher, full, hm, tm, a, cc)
        blocks[full // _BLOCK] = z0
        s0, s1, s2 = s0 + z0, s1 + t1, s2 + t2
    total, g, k2, _, _ = _cumulants(c, cc, s0, s1, s2, 0.0, 0.0)
    return total, g, k2, 0.0, 0.0


@_jit
def _tilted_pass_with_series(theta, teacher, alpha, h_max, t_max, c, blocks):
    """:func:`_tilted_pass` that also sums w·d³ and w·d⁴, for κ3 and κ4 (returned last).

    About 20–30% slower a pass; it pays on a step from a warm start, where those terms take
    E[d]'s series to the root (:func:`_series_step`). A loop of its own rather than a flag
    in :func:`_tilted_pass`: a branch inside the loop stopped it vectorising (10× slower).
    """
    n = theta.size
    full = n - n % _BLOCK
    a, hm, tm, cc = np.float32(alpha), np.float32(h_max), np.float32(t_max), np.float32(c)
    s0 = s1 = s2 = s3 = s4 = 0.0
    for k in range(full // _BLOCK):
        z0 = z1 = z2 = z3 = z4 = np.float32(0.0)
        for i in range(k * _BLOCK, (k + 1) * _BLOCK):
            w, dc = _weight_and_d(theta[i], teacher[i], hm, tm, a, cc)
            wd = w * dc
            wd2 = wd * dc
            wd3 = wd2 * dc
            z0 += w
            z1 += wd
            z2 += wd2
            z3 += wd3
            z4 += wd3 * dc
        blocks[k] = z0
        s0 += z0
        s1 += z1
        s2 += z2
        s3 += z3
        s4 += z4
    if full < n:
        z0, t1, t2, t3, t4 = _tail_sums(theta, teacher, full, hm, tm, a, cc)
        blocks[full // _BLOCK] = z0
        s0, s1, s2, s3, s4 = s0 + z0, s1 + t1, s2 + t2, s3 + t3, s4 + t4
    return _cumulants(c, cc, s0, s1, s2, s3, s4)


@_jit_inline
def _series_step(g, k2, k3, k4):
    """The α step δ that zeroes E[d]'s Taylor series at the evaluated α, g + κ2·δ + κ3·δ²/2 + κ4·δ³/6.

    E[d] at α + δ is the derivative of log Σ exp(log π_θ + (α + δ)·d), whose higher
    derivatives are the cumulants, so this is Newton's step with three more terms: its error
    falls as δ⁴ rather than δ². Solved by Newton's method on the cubic from Newton's step;
    returns Newton's step where the series is no help (the correction would exceed the step,
    as far from α, beyond the series' radius of convergence).
    """
    newton = -g / k2
    step = newton
    for _ in range(8):
        value = g + step * (k2 + step * (0.5 * k3 + step * k4 / 6.0))
        slope = k2 + step * (k3 + 0.5 * step * k4)
        if not slope > 0.0:
            return newton
        step -= value / slope
    return step if abs(step - newton) <= 0.5 * abs(newton) and abs(step) <= _HUGE else newton


@_jit_inline
def _edited_weight(h, t, h_max, t_max, a32, alpha, theta_shift, count, seen, masked, bonus, rep, freq, pres):
    """The weight (float64) of an edited token: 0 where masked, else its mixture weight with the penalties applied
    to its logit z = (1 − α)·(h + ``theta_shift``) + α·t (``theta_shift``: theta's log-normaliser where its rows are
    log-softmax outputs) where it was ``seen`` in the prompt or the output, times exp(``bonus``) (the diversity's
    −λ·c)."""
    if masked:
        return 0.0
    log_w = np.float64(_log_weight(h, t, h_max, t_max, a32))
    z = (1.0 - alpha) * (np.float64(h) + theta_shift) + alpha * np.float64(t)
    zp = z
    if seen:
        if rep != 1.0:
            zp = z / rep if z > 0.0 else z * rep
        zp -= freq * count + (pres if count > 0.0 else 0.0)
    return math.exp(log_w + (zp - z) + bonus)


@_jit
def _draw(theta, teacher, alpha, h_max, t_max, blocks, total, u, ids, weights, n_ids):
    """Inverse-CDF draw from the block sums ``blocks`` (their sum ``total``), with the edited tokens ``ids[:n_ids]``
    (ascending) at ``weights`` and every other token at its mixture weight."""
    n = theta.size
    a = np.float32(alpha)
    hm = np.float32(h_max)
    tm = np.float32(t_max)
    target = u * total
    before = 0.0
    k = -1
    last_positive = -1
    for i in range(blocks.size):
        if blocks[i] > 0.0:
            last_positive = i
            if before + blocks[i] >= target:
                k = i
                break
        before += blocks[i]
    if k < 0:  # rounding put the target past the end
        k = last_positive
        before = total - blocks[k]
    start = k * _BLOCK
    stop = min(start + _BLOCK, n)
    first = 0
    while first < n_ids and ids[first] < start:
        first += 1
    # blocks[k] is a vectorised float32 sum; re-summed in this loop's order it can differ in the
    # last bits, and a target past the re-sum would fall through to the block's last token. So
    # the target keeps its fraction of the block and is placed on the re-sum.
    inside = 0.0
    j = first
    for i in range(start, stop):
        if j < n_ids and ids[j] == i:
            inside += weights[j]
            j += 1
        else:
            inside += _exp32(_log_weight(theta[i], teacher[i], hm, tm, a))
    goal = min(max((target - before) / blocks[k], 0.0), 1.0) * inside
    cum = 0.0
    token = -1
    j = first
    for i in range(start, stop):
        if j < n_ids and ids[j] == i:
            w = weights[j]
            j += 1
        else:
            w = np.float64(_exp32(_log_weight(theta[i], teacher[i], hm, tm, a)))
        if w > 0.0:
            token = i
            cum += w
            if cum >= goal:
                break
    return token


@_jit
def _solve_and_draw(theta, teacher, theta_normalized, solver, alpha0, force_one, u, edits, edit_weights, blocks, out):
    """Decide one row; ``out`` (zeros) receives (token, α, log π_t, log π_θ, log q, status, passes, unconverged).
    Returns the passes made.

    ``solver`` is the batch's (method, fixed α, α bounds lo and hi, tol, xtol, max_passes); ``edits`` the row's
    (edit_ids, edit_count, edit_seen, edit_masked, edit_bonus, n_edits, penalty), :class:`RowEdits`' arrays.
    The edited tokens ``edit_ids[:n_edits]`` (ascending; :class:`RowEdits`) change q after α is solved, as the
    reference's stages do: masked ones leave it, the ones ``edit_seen`` take the penalties ``penalty`` (repetition,
    frequency, presence, theta's log-normaliser shift) with their output counts ``edit_count``, and each is
    multiplied by exp(``edit_bonus``). ``edit_weights``
    is scratch for their weights. An α solve still open after ``max_passes`` evaluations (the last one tested too,
    as the reference's solver does) hands the row back, flagged unconverged.
    """
    method, fixed_alpha, lo, hi, tol, xtol, max_passes = solver
    edit_ids, edit_count, edit_seen, edit_masked, edit_bonus, n_edits, penalty = edits
    t_max, h_max, lse_t, lse_h, finite = _maxima_and_log_normalisers(teacher, theta, theta_normalized)
    if not finite:
        out[5] = _ROW_FALLBACK
        return 0
    c = (lse_t - t_max) - (lse_h - h_max)

    if force_one:
        alpha = 1.0
    elif method == 0:
        alpha = min(max(fixed_alpha, lo), hi)
    else:
        alpha = min(max(alpha0, lo), hi)
    solve = method == 1 and not force_one and lo < hi
    # The first evaluation's step is the long one, from the warm start: only there do κ3 and κ4 pay.
    if solve:
        s0, g, k2, k3, k4 = _tilted_pass_with_series(theta, teacher, alpha, h_max, t_max, c, blocks)
    else:
        s0, g, k2, k3, k4 = _tilted_pass(theta, teacher, alpha, h_max, t_max, c, blocks)
    passes = 1
    unconverged = False
    if solve:
        low, high = lo, hi
        prev_abs_g = np.inf
        lo_tried = False
        hi_tried = False
        while True:
            if s0 < _TINY:
                break
            slope = max(k2, 0.0)
            at_lo = alpha <= lo
            at_hi = alpha >= hi
            lo_tried = lo_tried or at_lo
            hi_tried = hi_tried or at_hi
            lo_b = low if g > 0 else alpha
            hi_b = alpha if g > 0 else high
            if abs(g) <= tol * slope or (at_lo and g >= 0) or (at_hi and g <= 0):
                break
            usable = 0 < slope <= _HUGE
            if usable:
                target = alpha + _series_step(g, slope, k3, k4)
            else:
                target = -np.inf if g > 0 else np.inf
            newton_ok = usable and lo_b < target < hi_b and abs(g) <= 0.5 * prev_abs_g
            if newton_ok and abs(target - alpha) <= xtol:
                break  # the reference would step to target; the draw reuses this pass instead
            if hi_b - lo_b <= xtol:
                break
            if passes >= max_passes:
                unconverged = True
                break
            nxt = target if newton_ok else 0.5 * (lo_b + hi_b)
            if target <= lo_b and lo_b <= lo and not (lo_tried or at_lo):
                nxt = lo
            elif target >= hi_b and hi_b >= hi and not (hi_tried or at_hi):
                nxt = hi
            low, high, prev_abs_g = lo_b, hi_b, abs(g)
            alpha = nxt
            s0, g, k2, k3, k4 = _tilted_pass(theta, teacher, alpha, h_max, t_max, c, blocks)
            passes += 1
    out[6] = passes
    out[7] = unconverged
    if unconverged or not s0 >= _TINY:
        out[5] = _ROW_FALLBACK
        return passes
    a32 = np.float32(alpha)
    total = s0
    if n_edits > 0:
        rep, freq, pres, shift = penalty[0], penalty[1], penalty[2], penalty[3]
        for j in range(n_edits):
            m = edit_ids[j]
            edit_weights[j] = _edited_weight(
                theta[m],
                teacher[m],
                h_max,
                t_max,
                a32,
                alpha,
                shift,
                edit_count[j],
                edit_seen[j],
                edit_masked[j],
                edit_bonus[j],
                rep,
                freq,
                pres,
            )
        # Per block holding edited tokens: their change, where they held at most half of the block's sum (the
        # subtraction then keeps the block's float32 precision); else the block summed again in float64.
        n = theta.size
        j = 0
        while j < n_edits:
            k = edit_ids[j] // _BLOCK
            first = j
            old = new = 0.0
            while j < n_edits and edit_ids[j] // _BLOCK == k:
                m = edit_ids[j]
                old += np.float64(_exp32(_log_weight(theta[m], teacher[m], h_max, t_max, a32)))
                new += edit_weights[j]
                j += 1
            if old <= 0.5 * blocks[k]:
                blocks[k] += new - old
                continue
            acc = 0.0
            e = first
            for i in range(k * _BLOCK, min((k + 1) * _BLOCK, n)):
                if e < j and edit_ids[e] == i:
                    acc += edit_weights[e]
                    e += 1
                else:
                    acc += np.float64(_exp32(_log_weight(theta[i], teacher[i], h_max, t_max, a32)))
            blocks[k] = acc
        total = 0.0
        for k in range(blocks.size):
            total += blocks[k]
        if not (_TINY <= total <= _HUGE):  # every token removed, or a penalty overflowed
            out[5] = _ROW_FALLBACK
            return passes
    token = _draw(theta, teacher, alpha, h_max, t_max, blocks, total, u, edit_ids, edit_weights, n_edits)
    if token < 0:
        out[5] = _ROW_FALLBACK
        return passes
    h = theta[token]
    t = teacher[token]
    log_weight = np.float64(_log_weight(h, t, h_max, t_max, a32))
    for j in range(n_edits):
        if edit_ids[j] == token:
            log_weight = math.log(edit_weights[j])
    out[0] = token
    out[1] = alpha
    out[2] = t - lse_t
    out[3] = h - lse_h
    out[4] = log_weight - math.log(total)
    out[5] = _ROW_OK
    return passes


@_jit
def _decide_batch(theta, teacher, theta_normalized, solver, alpha0, force_one, u, edits, out):
    """:func:`_solve_and_draw` for every row; ``edits`` holds :class:`RowEdits`' ``[b, ...]`` arrays, in its order."""
    ids, count, seen, masked, bonus, n, penalty = edits
    blocks = np.empty((theta.shape[1] + _BLOCK - 1) // _BLOCK, dtype=np.float64)
    edit_weights = np.empty(ids.shape[1], dtype=np.float64)
    passes = 0
    for r in range(theta.shape[0]):
        row = (ids[r], count[r], seen[r], masked[r], bonus[r], n[r], penalty[r])
        passes += _solve_and_draw(
            theta[r],
            teacher[r],
            theta_normalized,
            solver,
            alpha0[r],
            force_one[r],
            u[r],
            row,
            edit_weights,
            blocks,
            out[r],
        )
    return passes


def decide_fused(
    models: ModelRows,
    uniforms: Sequence[float],
    force_teacher: Sequence[bool],
    alpha_computer: AlphaComputer,
    alpha_init: torch.Tensor | None,
    edits: RowEdits | None = None,
) -> tuple[np.ndarray, int]:
    """Decide the ``[b, V]`` rows of a one-teacher roster with the kernel; returns (``[b, 8]`` float64 in
    :class:`~dual_sampling.decision.fusable.KernelColumn`'s columns, passes in all rows).

    θ's rows may be log-softmax outputs already (``models.normalized``). ``edits`` are the rows' masked and penalised
    tokens (:func:`row_edits`; None: no row has any).
    """
    teacher = np.ascontiguousarray(models.teacher.detach().float().numpy())
    theta = np.ascontiguousarray(models.student.detach().float().numpy())
    theta_normalized = models.is_normalized(models.student_position)
    b = teacher.shape[0]
    method = KERNEL_ALPHA_METHODS[type(alpha_computer)]
    fixed = float(alpha_computer.alpha) if method == 0 else 0.5
    tol, xtol = (1e-6, 1e-7) if method == 0 else alpha_computer.tolerances(torch.float32)
    if alpha_init is None:
        alpha0 = np.full(b, 0.5)
    else:
        alpha0 = np.nan_to_num(alpha_init.detach().double().numpy().reshape(-1), nan=0.5)
    out = np.zeros((b, 8), dtype=np.float64)
    edits = edits or RowEdits.none(b)
    solver = (
        method,
        fixed,
        float(alpha_computer.alpha_min),
        float(alpha_computer.alpha_max),
        float(tol),
        float(xtol),
        _MAX_PASSES,
    )
    passes = _decide_batch(
        theta,
        teacher,
        theta_normalized,
        solver,
        np.ascontiguousarray(alpha0, dtype=np.float64),
        np.asarray(force_teacher, dtype=np.bool_),
        np.asarray(uniforms, dtype=np.float64),
        (edits.ids, edits.count, edits.seen, edits.masked, edits.bonus, edits.n, edits.penalty),
        out,
    )
    return out, int(passes)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel now, so no decoding step pays for it."""
    g = torch.Generator().manual_seed(0)
    teacher, theta = torch.randn(2, 3 * _BLOCK + 5, generator=g), torch.randn(2, 3 * _BLOCK + 5, generator=g)
    # The edited tokens' pass too (every min_tokens row takes it): a masked row, and a penalised diverse one.
    plain = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, diversity_penalty=0.0)
    rows = [
        SimpleNamespace(**{**plain, "min_tokens": 2, "stop_token_ids": (1,), "prompt_token_ids": ()}),
        SimpleNamespace(
            **{**plain, "repetition_penalty": 1.1, "diversity_penalty": 1.0, "group": 1},
            min_tokens=0,
            stop_token_ids=(),
            prompt_token_ids=(2, 3),
        ),
    ]
    edits = row_edits(rows, [0, 1], [[], [4]], teacher.shape[1], [0.0, 0.0], [{}, {5: 1}])
    for computer in (FixedAlpha(), KLSymmetryAlpha()):
        decide_fused(ModelRows.pair(teacher, theta), [0.5, 0.25], [False, True], computer, None)
        decide_fused(ModelRows.pair(teacher, theta), [0.5, 0.25], [False, False], computer, None, edits=edits)
