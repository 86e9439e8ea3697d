"""The leader engine's processor (the teacher's in a pair): the one place where each token is decided.

For every row it waits for each follower's logits row of the same request and step, then, for all
rows that are ready at once: gathers every model's rows in roster order (``ModelRows``), solves α,
mixes, draws (``dual_sampling.decision.pipeline``), writes the token and its records (the roster's
columns) to shared memory, and wakes the followers. Every engine runs the same requests at every
step (the schedulers see to it), so the followers' rows for a step arrive in one round; rows are
still served in whatever order they become ready. A request that names some teachers only
(``Slot.PARTICIPANTS``) waits for their rows alone, and the rows of the teachers it leaves out are
taken as θ's at weight 0 (``ModelRows.absent``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import Decision, ModelRows, decide
from dual_sampling.decision.result import dense_top
from dual_sampling.lockstep import Bell, ErrorCode, ModelSlot, ModelWord, Slot, Stat, slot_word
from dual_sampling.lockstep.row_channel import RowGatherer
from dual_sampling.roster import Roster
from processors.base import BaseSyncLogitsProcessor, TrackedRow

__all__ = ["LeaderLogitsProcessor"]

_MIN_ROWS_TO_SPLIT = 4
"""Fewer ready rows than this are decided in one piece: splitting would cost more than it saves."""


def diversity_ranks(ready: list[tuple[int, TrackedRow]]) -> list[int]:
    """Each row's rank in its diverse group among ``ready`` (0 for the group's first by member order, and for every
    row without a diversity penalty)."""
    members: dict[int, list[int]] = {}
    for _, row in ready:
        if row.sampling.diverse:
            members.setdefault(row.sampling.group, []).append(row.sampling.member)
    return [
        sorted(members[row.sampling.group]).index(row.sampling.member) if row.sampling.diverse else 0
        for _, row in ready
    ]


def diversity_order(ready: list[tuple[int, TrackedRow]]) -> list[tuple[int, TrackedRow]]:
    """``ready`` by rank in its diverse group (stable): rank 0 of every group, with every other row, first."""
    ranks = diversity_ranks(ready)
    return [item for _, item in sorted(zip(ranks, ready), key=lambda pair: pair[0])]


class LeaderLogitsProcessor(BaseSyncLogitsProcessor):
    """The leader: reads each follower's row, decides the token from q, publishes it and the records."""

    leads = True

    def attach(self, vllm_config, device: torch.device) -> None:
        super().attach(vllm_config, device)
        self.roster = Roster(self.config.roster)
        # The leader's rows are its raw logits; every follower's arrive normalised (its engine took the log-softmax).
        self._normalized = (False, *(True,) * (len(self.roster.names) - 1))
        self._row_steps = [(p, slot_word(ModelSlot.ROW_STEP, p)) for p in range(1, len(self.roster.names))]
        self._own_rows = RowGatherer(self.vocab)
        self.alpha_computer = get_alpha_computer(self.config.alpha_method, **self.config.alpha_config)
        self._taken: dict[int, dict[int, int]] = {}
        """Per diverse group, the tokens its members took at this step so far, with their counts."""
        if device.type == "cpu":
            # Compiled (or loaded from numba's cache) now, not in the first decoding step; already loaded in a worker
            # forked from the fork server (driver.engine_server). Imported only now: a spawned worker's start-up scan
            # of loaded modules for Triton kernels fails on numba's objects.
            from dual_sampling.decision import kernel

            kernel.warm_up()
        # While the leader decides, the followers only wait for the tokens: their CPUs can take half the rows.
        helper_cpus = self.config.mix_helper_cpus
        self._helper = None
        if helper_cpus and device.type == "cpu":
            self._helper = ThreadPoolExecutor(
                1,
                thread_name_prefix="dual-sampling-mix",
                initializer=os.sched_setaffinity,
                initargs=(0, set(helper_cpus)),
            )

    def _warm_alpha(self, part: list[tuple[int, TrackedRow]], device: torch.device) -> torch.Tensor:
        """The rows' last α, ``[b]`` (``[b, K]`` with K teachers; a row with none yet splits 0.5 among them)."""
        k = len(self.roster.alpha_columns)  # one α per teacher
        if k == 1:
            return torch.tensor([row.alpha for _, row in part], dtype=torch.float32, device=device)
        warm = [row.alpha if isinstance(row.alpha, list) else [row.alpha / k] * k for _, row in part]
        return torch.tensor(warm, dtype=torch.float32, device=device)

    def _decide_rows(self, rows: list[torch.Tensor], ready: list[tuple[int, TrackedRow]]) -> Decision:
        """decide() for these rows; with a helper thread, its first half runs there, at the same time. Rows of
        diverse groups (``ready`` in :func:`diversity_order`) are decided rank by rank, each rank seeing the tokens
        its group's members took before it at this step."""

        # Every part uses the same k, so the parts' top-k tensors join.
        top_logprobs = max(row.sampling.top_logprobs for _, row in ready)
        dense_k = max(row.sampling.dense_logprobs for _, row in ready)

        def run(lo: int, hi: int, diversity: list[dict[int, int]] | None = None) -> Decision:
            part = ready[lo:hi]
            warm = self._warm_alpha(part, rows[0].device)
            slots = [row.slot for _, row in part]
            # Every follower's rows are log-softmax outputs (its engine normalised them), with their log-normalisers
            # where a repetition penalty needs them; the leader's rows are its raw logits.
            normalisers = self.session.follower_log_normalisers
            models = ModelRows(
                tuple(r[lo:hi] for r in rows),
                self.roster,
                self._normalized,
                (None, *(torch.from_numpy(normalisers[f, slots]) for f in range(len(rows) - 1))),
                self._absent(part),
            )
            d = decide(
                models,
                [row.step for _, row in part],
                [row.sampling for _, row in part],
                self.alpha_computer,
                warm,
                top_logprobs=top_logprobs,
                outputs=[row.output_token_ids for _, row in part],
                diversity=diversity,
            )
            if dense_k:
                d.dense_ids, d.dense_logp = dense_top(models, dense_k, d)
            return d

        n = len(ready)
        if any(row.sampling.diverse for _, row in ready):
            ranks = diversity_ranks(ready)
            parts, lo = [], 0
            while lo < n:
                hi = lo + ranks[lo:].count(ranks[lo])  # one rank: consecutive in diversity order
                chunk = ready[lo:hi]
                d = run(
                    lo,
                    hi,
                    [dict(self._taken.get(row.sampling.group, {}) if row.sampling.diverse else {}) for _, row in chunk],
                )
                for (_, row), token, ok in zip(chunk, d.tokens.tolist(), d.ok.tolist()):
                    if ok and row.sampling.diverse:
                        taken = self._taken.setdefault(row.sampling.group, {})
                        taken[token] = taken.get(token, 0) + 1
                parts.append(d)
                lo = hi
            return Decision.concatenate(parts)
        if self._helper is None or n < _MIN_ROWS_TO_SPLIT:
            return run(0, n)
        first = self._helper.submit(run, 0, n // 2)
        try:
            second = run(n // 2, n)
        except Exception:
            wait([first])  # its rows are decided again, one by one, once this raises
            raise
        return Decision.concatenate([first.result(), second])

    def synchronise(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        s = self.session
        control = s.control
        decided: dict[int, int] = {}
        pending = dict(batch)
        self._taken.clear()  # a new step: no member of any group has taken a token yet
        s.add_model_stat(0, ModelWord.STEPS, 1)
        start = time.monotonic()
        deadline = start + self.sync_timeout
        mixing_s, rounds = 0.0, 0
        while pending:
            seen = s.bell_value(Bell.ROWS)
            publications = self._publications()
            ready = []
            for i, row in list(pending.items()):
                if self.abandoned(row):
                    decided[i] = row.filler
                    del pending[i]
                    s.add_model_stat(0, ModelWord.ABANDONED, 1)
                elif all(
                    control[row.slot, word] == row.step for p, word in self._row_steps if row.participants >> p & 1
                ):
                    ready.append((i, row))
            if ready and len(ready) < len(pending) and self._publication_overlapped(publications):
                # The scan raced a follower's stores: the rest of this step's rows are on their way. Deciding now
                # would still be correct, but in two rounds; wait for the followers' bell and scan again.
                self.wait(Bell.ROWS, seen, deadline)
                if time.monotonic() < deadline:
                    continue
            for i, _ in ready:
                del pending[i]
            if ready:
                rounds += 1
                t0 = time.perf_counter()
                decided.update(self._decide(logits, ready))
                mixing_s += time.perf_counter() - t0
                continue
            if not pending:
                break
            if time.monotonic() >= deadline:
                self.time_out(pending, decided)
                s.add_model_stat(0, ModelWord.TIMEOUTS, len(pending))
                break
            self.wait(Bell.ROWS, seen, deadline)
        if rounds > 1:
            s.add_stat(Stat.SPLIT_STEPS, 1)
        s.add_stat(Stat.MIX_NS, int(mixing_s * 1e9))
        s.add_model_stat(0, ModelWord.WAIT_NS, int((time.monotonic() - start - mixing_s) * 1e9))
        return decided

    def _absent(self, part: list[tuple[int, TrackedRow]]) -> torch.Tensor | None:
        """``[b, M]`` bool: per row, the models its request leaves out (their rows were never published); None when
        every row has every model."""
        models = len(self.roster.names)
        every = (1 << models) - 1
        if all(row.participants & every == every for _, row in part):
            return None
        return torch.tensor([[not row.participants >> p & 1 for p in range(models)] for _, row in part])

    def _publications(self) -> list[int]:
        """Each follower's publication sequence word."""
        return self.session.model_words[1:, ModelWord.PUBLICATIONS].tolist()

    def _publication_overlapped(self, before: list[int]) -> bool:
        """Whether a follower was storing a step's rows at some point of a scan that began with ``before`` read."""
        return any(word % 2 == 1 for word in before) or self._publications() != before

    def _decide(self, logits: torch.Tensor, ready: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        s = self.session
        ready = diversity_order(ready)
        # The followers' rows are read in place from shared memory when their slots are consecutive: a follower
        # rewrites a slot's row only after this step's token for it is published, below.
        rows = [self._own_rows(logits, [i for i, _ in ready])]
        try:
            slots = [row.slot for _, row in ready]
            rows += [channel.read(slots, rows[0].device) for channel in self.row_channels]
        except Exception:
            # The channel failed (a device error, say): these rows' requests fail by name, and the engine goes on.
            for _, row in ready:
                self._fail_row(row, "reading a follower's row")
            return {i: row.filler for i, row in ready}
        # One reduction per model: NaN or +inf makes the row max non-finite, and so does a row with nothing finite.
        # A model a request leaves out published nothing for it: whatever its slot holds is not looked at.
        bad_rows = torch.stack([~torch.isfinite(r.amax(-1)) for r in rows])  # [M, b]
        absent = self._absent(ready)
        if absent is not None:
            bad_rows &= ~absent.T.to(bad_rows.device)
        bad = bad_rows.any(0).tolist()
        decided = {}
        for (i, row), is_bad in zip(ready, bad):
            if is_bad:
                s.fail_slot(row.slot, row.key, ErrorCode.BAD_LOGITS, row.step, self.writer)
                decided[i] = row.filler
        good = [k for k, is_bad in enumerate(bad) if not is_bad]
        if not good:
            return decided
        if len(good) < len(ready):
            ready = [ready[k] for k in good]
            rows = [r[good] for r in rows]
        taken = {group: dict(tokens) for group, tokens in self._taken.items()}
        try:
            parts = [(ready, self._decide_rows(rows, ready))]
        except Exception:
            self._taken = taken  # the rows are decided again one by one: no member's token may count twice
            # One row's settings (a top_k beyond int64, say) make the whole batch raise: decide each row
            # alone and fail only the rows that still raise, so the engine and the other requests go on.
            parts = []
            for k, (i, row) in enumerate(ready):
                try:
                    parts.append(([(i, row)], self._decide_rows([r[k : k + 1] for r in rows], [(i, row)])))
                except Exception:
                    self._fail_row(row, "deciding its token")
                    decided[i] = row.filler
        for part, d in parts:
            self._publish(part, d, decided)
            for stat, flags in ((Stat.KERNEL_HANDED_BACK, d.handed_back), (Stat.KERNEL_UNCONVERGED, d.unconverged)):
                if flags is not None:  # host tensors: counting them waits for nothing
                    s.add_stat(stat, int(flags.sum()))
        s.ring(Bell.TOKENS, self.writer)
        s.add_model_stat(0, ModelWord.ROWS, len(ready))
        return decided

    def _publish(self, ready: list[tuple[int, TrackedRow]], d: Decision, decided: dict[int, int]) -> None:
        """Write each row's token and records to its slot, or fail the row; put its token in ``decided``."""
        s = self.session
        records = d.token_records().cpu()
        finite = torch.isfinite(records).all(-1).tolist()
        alphas = d.alpha.cpu().tolist()
        control = s.control
        top = None
        if d.top_ids is not None:
            top = (d.top_ids.cpu().numpy(), d.top_logq.cpu().numpy(), d.top_logp.cpu().numpy())
        dense = None if d.dense_ids is None else (d.dense_ids.cpu().numpy(), d.dense_logp.cpu().numpy())
        rows_out = zip(ready, d.tokens.cpu().tolist(), d.ok.cpu().tolist(), records.numpy(), finite, alphas)
        for k, ((i, row), tok, row_ok, record, is_finite, a) in enumerate(rows_out):
            decided[i] = row.filler
            if not row_ok or row.step >= s.layout.max_steps:
                s.fail_slot(row.slot, row.key, ErrorCode.BAD_LOGITS, row.step, self.writer)
                continue
            if not is_finite or (
                dense is not None and not np.isfinite(dense[1][k, ..., : row.sampling.dense_logprobs]).all()
            ):
                # Never training data: a NaN log q once came with a wrong token and ok=True.
                s.fail_slot(row.slot, row.key, ErrorCode.NON_FINITE, row.step, self.writer)
                continue
            try:
                s.records[row.slot, row.step] = record
                if top is not None and row.sampling.top_logprobs:
                    n = row.sampling.top_logprobs
                    s.top_ids[row.slot, row.step, :n] = top[0][k, :n]
                    s.top_logq[row.slot, row.step, :n] = top[1][k, :n]
                    s.top_logp[row.slot, row.step, :, :n] = top[2][k, :, :n]
                if dense is not None and row.sampling.dense_logprobs:
                    n = row.sampling.dense_logprobs
                    s.dense_ids[row.slot, row.step, :, :n] = dense[0][k, :, :n]
                    s.dense_logp[row.slot, row.step, ..., :n] = dense[1][k, ..., :n]
            except Exception:
                self._fail_row(row, "recording its token")
                continue
            s.tokens[row.slot, row.step] = tok
            control[row.slot, Slot.NUM_RECORDS] = row.step + 1
            control[row.slot, Slot.TOKEN] = tok
            control[row.slot, Slot.DECIDED_STEP] = row.step  # written last: it publishes the fields above
            row.alpha = a
            decided[i] = tok
