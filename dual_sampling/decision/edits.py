"""The rows' edits: the sparse changes to q after α is solved, in the form both fused kernels take.

A row's edited tokens are its stop tokens masked before ``min_tokens`` (weight 0), the tokens its penalties touch
(its prompt's and output's, whose weight the penalised mixture logit gives) and the tokens its diverse group's
earlier members took at this step (each −λ per member). Every other token keeps its mixture weight, so a kernel
sums q's weights in its passes as if nothing were edited and then corrects the edited tokens' blocks and total:
``dual_sampling.decision.kernel`` on the CPU, ``dual_sampling.decision.gpu_kernel`` on CUDA. The lists are built
here, once per batch, by one compiled pass over the rows' token lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from dual_sampling.decision.stages.diversity import Diversity
from dual_sampling.decision.stages.penalties import Penalties

__all__ = ["RowEdits", "row_edits"]

_jit = numba.njit(cache=True, nogil=True)
_jit_inline = numba.njit(cache=True, nogil=True, inline="always")


@dataclass
class RowEdits:
    """Both kernels' form of each row's edited tokens (the sparse changes to q after α is solved): ``[b, m]`` arrays
    of distinct in-vocabulary ids per row, ascending, the first ``n[r]`` of row r used (m ≥ 1)."""

    ids: np.ndarray
    """int64 token ids."""
    count: np.ndarray
    """float64: times the output holds each (the frequency and presence penalties read it)."""
    seen: np.ndarray
    """bool: in the prompt or the output, where the row's penalties are on (they apply to it)."""
    masked: np.ndarray
    """bool: removed from q (a stop token before min_tokens), whatever its penalty."""
    bonus: np.ndarray
    """float64: added to its log-weight after the penalties (the diversity's −λ·c; 0 elsewhere)."""
    n: np.ndarray
    """``[b]`` int64: edited tokens per row."""
    penalty: np.ndarray
    """``[b, 4]`` float64: repetition, frequency and presence penalties, and the shift that makes theta's row its raw
    logits (its log-normaliser where the rows are log-softmax outputs and the repetition penalty is on, else 0)."""

    @classmethod
    def none(cls, rows: int) -> RowEdits:
        """No row edits a token."""
        return cls.empty(rows, 1)

    @classmethod
    def empty(cls, rows: int, width: int) -> RowEdits:
        """Room for ``width`` edited tokens per row, none used."""
        return cls(
            np.zeros((rows, width), np.int64),
            np.zeros((rows, width)),
            np.zeros((rows, width), np.bool_),
            np.zeros((rows, width), np.bool_),
            np.zeros((rows, width)),
            np.zeros(rows, np.int64),
            np.tile([1.0, 0.0, 0.0, 0.0], (rows, 1)),
        )


@_jit_inline
def _mark(tokens, lo, hi, bit, vocab, state, row_ids, k, tally, step):
    """Mark ``tokens[lo:hi]`` (ids outside [0, vocab) skipped) with ``bit`` in ``state``, append each id not yet
    marked to ``row_ids`` from position ``k``, and add ``step`` to its ``tally``; return the new ``k``."""
    for j in range(lo, hi):
        t = tokens[j]
        if 0 <= t < vocab:
            if state[t] == 0:
                row_ids[k] = t
                k += 1
            state[t] |= bit
            tally[t] += step
    return k


@_jit
def _collect_edits(
    vocab, prompt, prompt_at, output, output_at, stops, stops_at, taken, taken_at, penalised, lam, edits_out
):
    """Fill ``edits_out`` (ids, count, seen, masked, bonus, n of a :class:`RowEdits`) from each row's flat token
    lists: row r's prompt is ``prompt[prompt_at[r]:prompt_at[r + 1]]``, likewise its output, its masked stop ids and
    the tokens its group's earlier members took at this step (``taken``, one entry per member). A row's prompt and
    output count only where ``penalised[r]``; ``lam[r]`` is its diversity penalty λ. Ids outside [0, vocab) are
    skipped."""
    ids, count, seen_out, masked_out, bonus, n = edits_out
    state = np.zeros(vocab, np.int8)  # bits: 1 seen (penalised), 2 masked, 4 taken by a member
    times = np.zeros(vocab, np.float64)
    members = np.zeros(vocab, np.float64)
    for r in range(n.size):
        k = 0
        if penalised[r]:
            k = _mark(prompt, prompt_at[r], prompt_at[r + 1], 1, vocab, state, ids[r], k, times, 0.0)
            k = _mark(output, output_at[r], output_at[r + 1], 1, vocab, state, ids[r], k, times, 1.0)
        k = _mark(stops, stops_at[r], stops_at[r + 1], 2, vocab, state, ids[r], k, times, 0.0)
        k = _mark(taken, taken_at[r], taken_at[r + 1], 4, vocab, state, ids[r], k, members, 1.0)
        ids[r, :k] = np.sort(ids[r, :k])
        for j in range(k):
            t = ids[r, j]
            count[r, j] = times[t]
            seen_out[r, j] = (state[t] & 1) != 0
            masked_out[r, j] = (state[t] & 2) != 0
            bonus[r, j] = -lam[r] * members[t]
            state[t] = 0
            times[t] = 0.0
            members[t] = 0.0
        n[r] = k


def _flat(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(the lists' tokens end to end as int64, the offsets where each starts, and the end)."""
    at = np.zeros(len(lists) + 1, np.int64)
    at[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(at[-1])) if at[-1] else np.zeros(0, np.int64)
    return flat, at


def row_edits(
    rows: Sequence,
    steps: Sequence[int],
    outputs: Sequence[Sequence[int]] | None,
    vocab: int,
    theta_shift: Sequence[float] | None,
    diversity: Sequence[dict[int, int]] | None = None,
) -> RowEdits | None:
    """The rows' edited tokens, or None where no row edits any: the stop tokens masked while a row's step is below
    min_tokens, the tokens its penalties touch (its prompt's and output's; ``outputs``: each row's generated tokens;
    ``theta_shift``: :attr:`RowEdits.penalty`'s shift per row, read only where a repetition penalty is on), and the
    tokens its group's earlier members took at this step (``diversity``, with their counts)."""
    penalties, diverse = Penalties(), Diversity()
    penalised = [penalties.used(row) for row in rows]
    stops = [row.stop_token_ids if step < row.min_tokens else () for row, step in zip(rows, steps)]
    taken = [
        [t for t, c in (diversity[r] if diversity is not None and diverse.used(row) else {}).items()
         for _ in range(c)]
        for r, row in enumerate(rows)
    ]  # fmt: skip
    if not any(penalised) and not any(stops) and not any(taken):
        return None
    if any(penalised) and outputs is None:
        raise ValueError("penalties need each row's generated tokens (outputs)")
    prompts = [row.prompt_token_ids if p else () for row, p in zip(rows, penalised)]
    generated = [outputs[r] if p else () for r, p in enumerate(penalised)]
    width = max(1, *(len(p) + len(o) + len(s) + len(t) for p, o, s, t in zip(prompts, generated, stops, taken)))
    edits = RowEdits.empty(len(rows), width)
    lam = np.array([row.diversity_penalty for row in rows], dtype=np.float64)
    parts = (edits.ids, edits.count, edits.seen, edits.masked, edits.bonus, edits.n)
    _collect_edits(
        vocab, *_flat(prompts), *_flat(generated), *_flat(stops), *_flat(taken), np.asarray(penalised), lam, parts
    )
    for r, row in enumerate(rows):
        if not penalised[r]:
            continue
        shift = 0.0
        if penalties.needs_logit_offset(row):
            if theta_shift is None:
                raise ValueError("the repetition penalty needs theta's log-normalisers (theta_log_normalisers)")
            shift = float(theta_shift[r])
        edits.penalty[r] = (row.repetition_penalty, row.frequency_penalty, row.presence_penalty, shift)
    return edits
