"""The per-token decision as one fused Triton kernel (GPU), for the rows that need no filter.

The GPU twin of :mod:`dual_sampling.decision.kernel` (the CPU's numba kernel): the same rows
(temperature 1, no top-k/top-p/min-p, no support constraint, no logit bias, no top
log-probabilities; the stop tokens masked before ``min_tokens``, the penalties and a group's diversity, the rows'
edits of :mod:`dual_sampling.decision.edits`, are allowed), the same alpha
computers (``fixed`` and ``kl_symmetry``) and the same algorithm. One program decides one row,
reading the vocabulary in ``BLOCK``-token blocks:

1. one pass for both rows' maxima and log-normalisers (online: a block that raises the maximum
   rescales the sum so far), which also finds any NaN or ±inf;
2. each α evaluation is one pass: it forms d = log π_t − log π_θ from maxima-shifted values,
   exponentiates the mixture's log-weight (1 − α)·log π_θ + α·log π_t once and sums w, w·d and
   w·d² (the first evaluation also w·d³ and w·d⁴), storing each block's Σw;
3. α is solved as on the CPU: the first step from the warm start by E_q[d]'s four-cumulant
   series, then Newton's steps on E_q[d] (whose slope in α is Var_q(d)) inside a bisection
   bracket, stopping on |E_q[d]| ≤ tol·Var_q(d) or a bracket under ``xtol``;
4. each edited token moves the total and its block's sum from its mixture weight to its edited one (0 where
   masked; where seen, the penalties on its mixture logit z = (1 − α)·ℓ_θ + α·ℓ_t; the diversity's factor), and
   the draw's block takes the edited weights too;
5. the draw is an inverse CDF in two levels: a cumulative sum over the block sums of the last
   evaluation finds the block holding u·Σw, then that block's weights are recomputed and
   summed up to the target's place in it. u comes from the same counter of (seed, step) as
   everywhere else, so a seed draws the same token on any device, up to float rounding at a
   CDF boundary. A barrier first: the block sums were stored by one thread, and the draw's
   vector load reads them from every warp.

Nothing in it waits on the host: per-row settings arrive as device tensors, and the result
``[b, 8]`` stays on the device until the caller copies it (with the tokens) once per step.
Rows it cannot decide (a non-finite entry, all weights underflowed, edits that took more than half of q's mass
away, where the CPU kernel re-sums the blocks in float64, or an α solve that did not converge in ``_MAX_PASSES``
passes, where the reference's solver raises) come back with status 1, for the torch reference.

Arithmetic: blocks are summed in float32 (a tree reduction) and blocks together in float64,
as the CPU kernel does with its 256-token blocks.

Triton is imported when this module is: callers import it only for CUDA rows (or in tests,
under Triton's interpreter, ``TRITON_INTERPRET=1`` set before the import).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from alpha import AlphaComputer
from dual_sampling.decision.edits import RowEdits
from dual_sampling.decision.fusable import KERNEL_ALPHA_METHODS
from dual_sampling.decision.rows import ModelRows

__all__ = ["BLOCK", "decide_gpu"]

BLOCK = 8192
"""Tokens per block: the unit of every pass and of the draw's first level. Each pass is a chain of dependent block
reductions, so it is bound by their latency, not by bandwidth: on an H200 (V = 151,936, b = 64, kl_symmetry) the
kernel took 0.97 ms with 1,024-token blocks and 4 warps, 0.39 ms with 4,096 and 16, 0.33 ms with 8,192 and 16."""
NUM_WARPS = 16
"""Warps per program (one program per row): 512 threads share each block's loads and reductions."""
_MAX_PASSES = 200
_TINY = 1e-30
_BLOCK_SCAN = 256  # block sums read at a time by the draw's first level


@triton.jit
def _load_block(t_row, h_row, start, V, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    """(token ids, in-vocabulary mask, teacher, theta) of the block at ``start``, float32; ``OTHER`` past V."""
    offs = start + tl.arange(0, BLOCK)
    inside = offs < V
    t = tl.load(t_row + offs, mask=inside, other=OTHER).to(tl.float32)
    h = tl.load(h_row + offs, mask=inside, other=OTHER).to(tl.float32)
    return offs, inside, t, h


@triton.jit
def _tilted(t_row, h_row, blocks_row, V, alpha, h_max, t_max, c, BLOCK: tl.constexpr, SERIES: tl.constexpr):
    """One evaluation at ``alpha``: (Σw, E_q[d], κ2, κ3, κ4) in float64; stores each block's Σw in ``blocks_row``.

    ``c`` is (lse_t − max t) − (lse_h − max h), so d = (t − max t) − (h − max h) − c; it enters the float32 loop
    rounded and its remainder is taken off E_q[d] in float64. κ3 and κ4 are 0 unless ``SERIES``.
    """
    a = alpha.to(tl.float32)
    hm = h_max.to(tl.float32)
    tm = t_max.to(tl.float32)
    cc = c.to(tl.float32)
    s0 = tl.zeros((), tl.float64)
    s1 = tl.zeros((), tl.float64)
    s2 = tl.zeros((), tl.float64)
    s3 = tl.zeros((), tl.float64)
    s4 = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        _, inside, t, h = _load_block(t_row, h_row, start, V, BLOCK, 0.0)
        hs = h - hm
        diff = (t - tm) - hs
        w = tl.where(inside, tl.exp(hs + a * diff), 0.0)
        dc = tl.where(inside, diff - cc, 0.0)
        wd = w * dc
        wd2 = wd * dc
        z0 = tl.sum(w, 0)
        tl.store(blocks_row + start // BLOCK, z0)
        s0 += z0.to(tl.float64)
        s1 += tl.sum(wd, 0).to(tl.float64)
        s2 += tl.sum(wd2, 0).to(tl.float64)
        if SERIES:
            wd3 = wd2 * dc
            s3 += tl.sum(wd3, 0).to(tl.float64)
            s4 += tl.sum(wd3 * dc, 0).to(tl.float64)
    safe = tl.maximum(s0, 1e-300)
    m1 = s1 / safe
    m2 = s2 / safe
    m3 = s3 / safe
    m4 = s4 / safe
    k2 = m2 - m1 * m1
    k3 = m3 - 3.0 * m1 * m2 + 2.0 * m1 * m1 * m1
    k4 = m4 - 4.0 * m1 * m3 - 3.0 * m2 * m2 + 12.0 * m1 * m1 * m2 - 6.0 * m1 * m1 * m1 * m1
    if not SERIES:
        k3 = tl.zeros((), tl.float64)
        k4 = tl.zeros((), tl.float64)
    g = m1 - (c - cc.to(tl.float64))
    return s0, g, k2, k3, k4


@triton.jit
def _series_step(g, k2, k3, k4):
    """The α step that zeroes g + κ2·δ + κ3·δ²/2 + κ4·δ³/6 (Newton on that cubic from Newton's step); Newton's step
    where the series is no help (a non-positive slope on the way, or a correction larger than half the step)."""
    newton = -g / k2
    step = newton
    bad = newton != newton
    for _ in range(8):
        value = g + step * (k2 + step * (0.5 * k3 + step * k4 / 6.0))
        slope = k2 + step * (k3 + 0.5 * step * k4)
        bad = bad | (slope <= 0.0) | (slope != slope)
        step = tl.where(bad, step, step - value / tl.where(bad, 1.0, slope))
    usable = (~bad) & (tl.abs(step - newton) <= 0.5 * tl.abs(newton)) & (tl.abs(step) < float("inf"))
    return tl.where(usable, step, newton)


@triton.jit
def _log_weight(h, t, h_max, t_max, a):
    """The mixture's log-weight relative to the row maxima, in float32, as :func:`_tilted` forms it."""
    hs = h - h_max
    return hs + a * ((t - t_max) - hs)


@triton.jit
def _edit(edits_row, j, t_row, h_row, h_max, t_max, a32, alpha, rep, freq, pres, shift):
    """Edit ``j`` of a row: (token id, or −1 where unused; its plain log-weight, float32; its edited log-weight,
    float64, −inf where masked). The penalties act on its mixture logit z = (1 − α)·(h + ``shift``) + α·t where it
    was seen (``shift``: theta's log-normaliser where its rows are log-softmax outputs), then the diversity's bonus
    is added; :func:`dual_sampling.decision.kernel._edited_weight` is the CPU's twin."""
    at = edits_row + 5 * j
    m = tl.load(at).to(tl.int64)
    safe = tl.where(m >= 0, m, 0)
    h = tl.load(h_row + safe).to(tl.float32)
    t = tl.load(t_row + safe).to(tl.float32)
    plain = _log_weight(h, t, h_max, t_max, a32)
    count = tl.load(at + 1)
    z = (1.0 - alpha) * (h.to(tl.float64) + shift) + alpha * t.to(tl.float64)
    zp = tl.where(rep != 1.0, tl.where(z > 0.0, z / rep, z * rep), z)
    zp = zp - freq * count - tl.where(count > 0.0, pres, 0.0)
    zp = tl.where(tl.load(at + 2) != 0.0, zp, z)
    edited = plain.to(tl.float64) + (zp - z) + tl.load(at + 4)
    edited = tl.where(tl.load(at + 3) != 0.0, -float("inf"), edited)
    return m, plain, edited


@triton.jit
def _decide_rows(
    teacher_ptr,
    theta_ptr,
    row_stride_t,
    row_stride_h,
    V,
    params_ptr,
    alpha0_ptr,
    force_ptr,
    u_ptr,
    penalty_ptr,
    edits_ptr,
    n_edits,
    blocks_ptr,
    n_blocks,
    out_ptr,
    METHOD: tl.constexpr,
    THETA_NORMALIZED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    TINY: tl.constexpr,
):
    """Decide row ``program_id(0)``; ``out`` receives (token, α, log π_t, log π_θ, log q, status, passes,
    unconverged).

    ``params`` holds (fixed α, alpha_min, alpha_max, tol, xtol) in float64 (scalar arguments would be float32);
    ``force`` (0 or 1), ``penalty`` (``[b, 5]``: repetition, frequency, presence, theta's shift, the row's count of
    edits) and ``edits`` (``[b, n_edits, 5]``: token id or −1, output count, seen, masked, bonus; each row loops over
    its own count only) are float64 too, parts of the same staged copy.
    """
    row = tl.program_id(0).to(tl.int64)
    fixed_alpha = tl.load(params_ptr + 0)
    lo = tl.load(params_ptr + 1)
    hi = tl.load(params_ptr + 2)
    tol = tl.load(params_ptr + 3)
    xtol = tl.load(params_ptr + 4)
    t_row = teacher_ptr + row * row_stride_t
    h_row = theta_ptr + row * row_stride_h
    blocks_row = blocks_ptr + row * n_blocks
    edits_row = edits_ptr + row * n_edits * 5
    rep = tl.load(penalty_ptr + row * 5 + 0)
    freq = tl.load(penalty_ptr + row * 5 + 1)
    pres = tl.load(penalty_ptr + row * 5 + 2)
    shift = tl.load(penalty_ptr + row * 5 + 3)
    row_edits = tl.load(penalty_ptr + row * 5 + 4).to(tl.int32)  # this row's edits: the rest are padding
    out_row = out_ptr + row * 8
    inf = float("inf")

    # 1. Maxima and log-normalisers of both rows, online, and whether every entry is finite.
    t_max = tl.full((), -inf, tl.float32)
    h_max = tl.full((), -inf, tl.float32)
    t_sum = tl.zeros((), tl.float64)
    h_sum = tl.zeros((), tl.float64)
    n_bad = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        offs, inside, t, h = _load_block(t_row, h_row, start, V, BLOCK, float("-inf"))
        bad = inside & ((tl.abs(t) == inf) | (t != t) | (tl.abs(h) == inf) | (h != h))
        n_bad += tl.sum(bad.to(tl.int32), 0)
        t_new = tl.maximum(t_max, tl.max(t, 0))
        t_sum = tl.where(t_sum > 0.0, t_sum * tl.exp((t_max - t_new).to(tl.float64)), 0.0)
        t_sum += tl.sum(tl.exp(t - t_new), 0).to(tl.float64)
        t_max = t_new
        h_new = tl.maximum(h_max, tl.max(h, 0))
        if not THETA_NORMALIZED:
            h_sum = tl.where(h_sum > 0.0, h_sum * tl.exp((h_max - h_new).to(tl.float64)), 0.0)
            h_sum += tl.sum(tl.exp(h - h_new), 0).to(tl.float64)
        h_max = h_new
    finite = (n_bad == 0) & (t_sum > 0.0)
    lse_t = t_max.to(tl.float64) + tl.log(tl.maximum(t_sum, 1e-300))
    lse_h = tl.zeros((), tl.float64)
    if not THETA_NORMALIZED:
        lse_h = h_max.to(tl.float64) + tl.log(tl.maximum(h_sum, 1e-300))
    c = (lse_t - t_max.to(tl.float64)) - (lse_h - h_max.to(tl.float64))
    c = tl.where(finite, c, 0.0)
    t_max = tl.where(finite, t_max, 0.0)
    h_max = tl.where(finite, h_max, 0.0)

    # 2-3. α: fixed (clamped), forced to 1, or solved from the warm start.
    force = tl.load(force_ptr + row) != 0
    alpha = tl.minimum(tl.maximum(tl.load(alpha0_ptr + row).to(tl.float64), lo), hi)
    if METHOD == 0:
        alpha = tl.minimum(tl.maximum(fixed_alpha, lo), hi)
    alpha = tl.where(alpha != alpha, 0.5, alpha)
    alpha = tl.where(force, 1.0, alpha)
    solve = (METHOD == 1) & (~force) & (lo < hi) & finite
    s0, g, k2, k3, k4 = _tilted(t_row, h_row, blocks_row, V, alpha, h_max, t_max, c, BLOCK, METHOD == 1)
    passes = tl.full((), 1, tl.int32)
    low = tl.zeros((), tl.float64) + lo
    high = tl.zeros((), tl.float64) + hi
    prev_abs_g = tl.full((), inf, tl.float64)
    lo_tried = alpha < -1.0  # False, as a scalar tensor
    hi_tried = alpha < -1.0
    unconverged = alpha < -1.0
    if METHOD == 1:  # no loop at all for fixed: Triton 3.6 crashes on a while loop whose condition is constant
        going = solve
        while going:
            slope = tl.maximum(k2, 0.0)
            at_lo = alpha <= lo
            at_hi = alpha >= hi
            lo_tried = lo_tried | at_lo
            hi_tried = hi_tried | at_hi
            lo_b = tl.where(g > 0.0, low, alpha)
            hi_b = tl.where(g > 0.0, alpha, high)
            stop = (s0 < TINY) | (tl.abs(g) <= tol * slope) | (at_lo & (g >= 0.0)) | (at_hi & (g <= 0.0))
            usable = (slope > 0.0) & (slope < inf)
            step = _series_step(g, tl.where(usable, slope, 1.0), k3, k4)
            target = tl.where(usable, alpha + step, tl.where(g > 0.0, -inf, inf))
            newton_ok = usable & (lo_b < target) & (target < hi_b) & (tl.abs(g) <= 0.5 * prev_abs_g)
            # Where Newton's next α is within xtol, the reference would step there; this pass is kept for the draw.
            stop = stop | (newton_ok & (tl.abs(target - alpha) <= xtol)) | (hi_b - lo_b <= xtol)
            nxt = tl.where(newton_ok, target, 0.5 * (lo_b + hi_b))
            to_lo = (target <= lo_b) & (lo_b <= lo) & (~(lo_tried | at_lo))
            to_hi = (~to_lo) & (target >= hi_b) & (hi_b >= hi) & (~(hi_tried | at_hi))
            nxt = tl.where(to_lo, lo, tl.where(to_hi, hi, nxt))
            # As the reference's solver: MAX_PASSES evaluations, the last one tested too.
            out_of_passes = (~stop) & (passes >= MAX_PASSES)
            unconverged = unconverged | out_of_passes
            if stop | out_of_passes:
                going = stop & (~stop)
            else:
                low = lo_b
                high = hi_b
                prev_abs_g = tl.abs(g)
                alpha = nxt
                s0, g, k2, k3, k4 = _tilted(t_row, h_row, blocks_row, V, alpha, h_max, t_max, c, BLOCK, False)
                passes += 1

    # 4. The edited tokens change q after α is solved, as in the reference: each moves the total and its block's
    # sum from its plain weight to its edited one (0 where masked). Where the edits took more than half of q's
    # mass, the subtraction would cancel: such a row goes to the reference (the CPU kernel re-sums its blocks).
    a32 = alpha.to(tl.float32)
    total = s0
    for j in range(0, row_edits):
        m, plain, edited = _edit(edits_row, j, t_row, h_row, h_max, t_max, a32, alpha, rep, freq, pres, shift)
        valid = m >= 0
        delta = tl.where(valid, tl.exp(edited) - tl.exp(plain).to(tl.float64), 0.0)
        total += delta
        at = blocks_row + tl.where(valid, m, 0) // BLOCK
        tl.store(at, tl.maximum(tl.load(at) + delta.to(tl.float32), 0.0), mask=valid)
        # Two edits in one block: the next load must see this store, whichever thread made it.
        tl.debug_barrier()
    # A total past 1e38 may hold a block sum past float32's range (a penalty that raised a logit by ~90 nats): the
    # draw could not place its target in that block, so the row goes to the reference.
    ok = finite & (s0 >= TINY) & (total >= 0.5 * s0) & (total < 1e38) & (~unconverged)

    # 5. The draw: the block holding u·Σw, from the block sums; then the token inside it.
    # The block sums (the last pass's and the masked ones) were stored by one thread; Triton orders global memory
    # only where it syncs shared memory, so without this barrier another warp could read a sum before its store.
    tl.debug_barrier()
    goal_total = tl.load(u_ptr + row).to(tl.float64) * total
    before = tl.zeros((), tl.float64)
    found = tl.full((), -1, tl.int64)
    found_before = tl.zeros((), tl.float64)
    last_positive = tl.full((), -1, tl.int64)
    for start in range(0, n_blocks, BLOCK_SCAN):
        offs = start + tl.arange(0, BLOCK_SCAN)
        sums = tl.load(blocks_row + offs, mask=offs < n_blocks, other=0.0).to(tl.float64)
        running = before + tl.cumsum(sums, 0)
        hit = (sums > 0.0) & (running >= goal_total)
        first = tl.min(tl.where(hit, offs, n_blocks), 0).to(tl.int64)
        here = (found < 0) & (first < n_blocks)
        found_before = tl.where(here, tl.sum(tl.where(offs == first, running - sums, 0.0), 0), found_before)
        found = tl.where(here, first, found)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(sums > 0.0, offs, -1), 0).to(tl.int64))
        before += tl.sum(sums, 0)
    past_end = found < 0  # rounding put the target past the end
    k = tl.where(past_end, tl.maximum(last_positive, 0), found)
    block_sum = tl.load(blocks_row + k).to(tl.float64)
    found_before = tl.where(past_end, total - block_sum, found_before)
    offs, inside, t, h = _load_block(t_row, h_row, k * BLOCK, V, BLOCK, 0.0)
    w = tl.where(inside, tl.exp(_log_weight(h, t, h_max, t_max, a32)), 0.0).to(tl.float64)
    for j in range(0, row_edits):
        m, plain, edited = _edit(edits_row, j, t_row, h_row, h_max, t_max, a32, alpha, rep, freq, pres, shift)
        if (m >= 0) & (m // BLOCK == k):  # a vector pass only for the edits in this block
            w = tl.where(offs == m, tl.exp(edited), w)
    # The block's sum was a float32 reduction; re-summed here in another order it differs in the last bits, so the
    # target keeps its fraction of the block and is placed on the re-sum.
    fraction = tl.minimum(tl.maximum((goal_total - found_before) / tl.maximum(block_sum, 1e-300), 0.0), 1.0)
    goal = fraction * tl.sum(w, 0)
    cum = tl.cumsum(w, 0)
    over = (w > 0.0) & (cum >= goal)
    token = tl.min(tl.where(over, offs, V), 0).to(tl.int64)
    token = tl.where(token < V, token, tl.max(tl.where(w > 0.0, offs, -1), 0).to(tl.int64))
    ok = ok & (token >= 0) & (last_positive >= 0)
    safe_token = tl.where(token >= 0, token, 0)
    t_tok = tl.load(t_row + safe_token).to(tl.float32)
    h_tok = tl.load(h_row + safe_token).to(tl.float32)
    log_w = _log_weight(h_tok, t_tok, h_max, t_max, a32).to(tl.float64)
    for j in range(0, row_edits):
        m, plain, edited = _edit(edits_row, j, t_row, h_row, h_max, t_max, a32, alpha, rep, freq, pres, shift)
        log_w = tl.where(m == safe_token, edited, log_w)
    log_q = log_w - tl.log(tl.maximum(total, 1e-300))
    tl.store(out_row + 0, safe_token.to(tl.float64))
    tl.store(out_row + 1, alpha)
    tl.store(out_row + 2, t_tok.to(tl.float64) - lse_t)
    tl.store(out_row + 3, h_tok.to(tl.float64) - lse_h)
    tl.store(out_row + 4, log_q)
    tl.store(out_row + 5, tl.where(ok, 0.0, 1.0).to(tl.float64))
    tl.store(out_row + 6, passes.to(tl.float64))
    tl.store(out_row + 7, unconverged.to(tl.float64))


def decide_gpu(
    models: ModelRows,
    uniforms: Sequence[float],
    force_teacher: Sequence[bool],
    alpha_computer: AlphaComputer,
    alpha_init: torch.Tensor | None,
    edits: RowEdits | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Decide the ``[b, V]`` rows of a one-teacher roster in one launch; returns ``[b, 8]`` float64 on the rows'
    device, in :class:`~dual_sampling.decision.fusable.KernelColumn`'s columns, without waiting for it.

    An unconverged α solve (not within ``_MAX_PASSES`` passes) has status 1 too, and the caller can count such rows
    apart from the other rows it hands to the reference. θ's rows may be log-softmax outputs already
    (``models.normalized``). ``uniforms`` (b floats), ``force_teacher`` (b bools: α = 1) and ``edits`` (the rows'
    masked, penalised and diverse tokens, :func:`~dual_sampling.decision.edits.row_edits`; None: no row has any) are
    host values, as the CPU kernel takes them; they reach the device in one copy. ``alpha_init`` ``[b]`` (on the rows'
    device) warm-starts kl_symmetry (0.5 where absent). ``block`` sets the block size (a power of two; the tests use
    small ones on small vocabularies), ``num_warps`` the warps of each row's program.
    """
    teacher_logits, theta_logits = models.teacher, models.student
    theta_normalized = models.is_normalized(models.student_position)
    method = KERNEL_ALPHA_METHODS.get(type(alpha_computer))
    if method is None:
        raise ValueError(f"alpha_computer {type(alpha_computer).__name__} has no GPU kernel (fixed, kl_symmetry)")
    b, vocab = teacher_logits.shape
    device = teacher_logits.device
    teacher = teacher_logits if teacher_logits.stride(-1) == 1 else teacher_logits.contiguous()
    theta = theta_logits if theta_logits.stride(-1) == 1 else theta_logits.contiguous()
    if alpha_init is None:
        alpha0 = torch.full((b,), 0.5, dtype=torch.float64, device=device)
    else:
        alpha0 = alpha_init.to(device, torch.float64).reshape(-1)
    edits = edits or RowEdits.none(b)
    width = edits.ids.shape[1]
    used = np.arange(width) < edits.n[:, None]
    # Per edit: (token id or −1, output count, seen, masked, bonus); ids are exact in float64.
    per_edit = np.stack(
        [np.where(used, edits.ids, -1), edits.count, edits.seen, edits.masked, edits.bonus], axis=-1
    ).astype(np.float64)
    tol, xtol = (1e-6, 1e-7) if method == 0 else alpha_computer.tolerances(torch.float32)
    fixed = float(alpha_computer.alpha) if method == 0 else 0.5
    limits = (fixed, float(alpha_computer.alpha_min), float(alpha_computer.alpha_max), float(tol), float(xtol))
    # Every host input in one float64 buffer and one copy: on an H200 machine each copy from pageable memory cost
    # about 45 µs of host time, five of them a third of decide()'s. Page-locked, the copy does not wait either.
    # Parts start at even offsets (16 bytes), so Triton's alignment specialisation compiles one kernel for every b.
    even = b + b % 2
    u_at, force_at = 8, 8 + even
    penalty_at = force_at + even
    edits_at = penalty_at + 5 * even
    host = torch.zeros(edits_at + per_edit.size, dtype=torch.float64, pin_memory=device.type == "cuda")
    staged = host.numpy()
    staged[:5] = limits
    staged[u_at : u_at + b] = uniforms
    staged[force_at : force_at + b] = force_teacher
    staged[penalty_at : penalty_at + 5 * b] = np.concatenate([edits.penalty, edits.n[:, None]], axis=1).reshape(-1)
    staged[edits_at:] = per_edit.reshape(-1)
    packed = host.to(device, non_blocking=True)
    n_blocks = triton.cdiv(vocab, block)
    blocks = torch.empty((b, n_blocks), dtype=torch.float32, device=device)
    out = torch.empty((b, 8), dtype=torch.float64, device=device)
    if b == 0:
        return out
    _decide_rows[(b,)](
        teacher,
        theta,
        teacher.stride(0),
        theta.stride(0),
        vocab,
        packed,
        alpha0,
        packed[force_at:],
        packed[u_at:],
        packed[penalty_at:],
        packed[edits_at:],
        width,
        blocks,
        n_blocks,
        out,
        METHOD=method,
        THETA_NORMALIZED=bool(theta_normalized),
        BLOCK=block,
        BLOCK_SCAN=_BLOCK_SCAN,
        MAX_PASSES=_MAX_PASSES,
        TINY=_TINY,
        num_warps=num_warps,
    )
    return out
