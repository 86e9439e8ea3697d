"""A follower engine's processor (θ's in a pair): publish the model's log-probability row, then force the leader's
token."""

from __future__ import annotations

import time

import torch

from dual_sampling.decision.stages import needs_logit_offset
from dual_sampling.lockstep import Bell, ErrorCode, ModelSlot, ModelWord, Slot, slot_word
from processors.base import BaseSyncLogitsProcessor, TrackedRow

__all__ = ["FollowerLogitsProcessor"]


class FollowerLogitsProcessor(BaseSyncLogitsProcessor):
    """A follower: one row copy out per step, one token id in; it never samples."""

    leads = False

    def synchronise(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        s = self.session
        control = s.control
        self._publish_rows(logits, [(i, row) for i, row in batch if not self.abandoned(row)])
        s.add_model_stat(self.position, ModelWord.STEPS, 1)
        decided: dict[int, int] = {}
        pending = dict(batch)
        start = time.monotonic()
        deadline = start + self.sync_timeout
        while pending:
            seen = s.bell_value(Bell.TOKENS)
            for i, row in list(pending.items()):
                if control[row.slot, Slot.DECIDED_STEP] == row.step and int(control[row.slot, Slot.KEY]) == row.key:
                    decided[i] = int(control[row.slot, Slot.TOKEN])
                elif self.abandoned(row):
                    decided[i] = row.filler
                    s.add_model_stat(self.position, ModelWord.ABANDONED, 1)
                else:
                    continue
                del pending[i]
            if not pending:
                break
            if time.monotonic() >= deadline:
                self.time_out(pending, decided)
                s.add_model_stat(self.position, ModelWord.TIMEOUTS, len(pending))
                break
            self.wait(Bell.TOKENS, seen, deadline)
        s.add_model_stat(self.position, ModelWord.WAIT_NS, int((time.monotonic() - start) * 1e9))
        return decided

    def _publish_rows(self, logits: torch.Tensor, rows: list[tuple[int, TrackedRow]]) -> None:
        """Normalise and publish every row in one copy, then their step words, then ring once.

        Should that raise, each row is published alone and only the rows that still raise fail.
        """
        if not rows:
            return
        s = self.session
        words = s.model_words[self.position]
        # Odd while this step's rows are stored, so the leader can tell a scan that saw only part of them.
        words[ModelWord.PUBLICATIONS] += 1
        try:
            try:
                published = self._store_rows(logits, rows)
            except Exception:
                published = []
                for i, row in rows:
                    try:
                        published += self._store_rows(logits, [(i, row)])
                    except Exception:
                        self._fail_row(row, "publishing its row")
            if published:
                # After the rows they announce.
                announce = slot_word(ModelSlot.ROW_STEP, self.position)
                s.control[[row.slot for row in published], announce] = [row.step for row in published]
        finally:
            words[ModelWord.PUBLICATIONS] += 1
        s.ring(Bell.ROWS, self.writer)
        s.add_model_stat(self.position, ModelWord.ROWS, len(published))

    def _store_rows(self, logits: torch.Tensor, rows: list[tuple[int, TrackedRow]]) -> list[TrackedRow]:
        """Store the rows' log-probabilities in their slots (not yet announced); return the rows stored."""
        s = self.session
        index = torch.tensor([i for i, _ in rows], dtype=torch.long, device=logits.device)
        # Normalised here, on this engine's cores, while the leader is still busy with its own model.
        logp = torch.log_softmax(logits[index, : self.vocab].float(), dim=-1)
        # NaN or +inf anywhere in a row makes its whole log-softmax NaN; so does a row with nothing finite.
        nan_rows = torch.isnan(logp[:, 0]).tolist()
        self.row_channels[0].publish([row.slot for _, row in rows], logp)
        # A stage on the mixture's raw logits (the repetition penalty): the leader needs this log-normaliser too.
        penalised = [k for k, (_, row) in enumerate(rows) if needs_logit_offset(row.sampling)]
        if penalised:
            lse = torch.logsumexp(logits[index[penalised], : self.vocab].double(), dim=-1).tolist()
            for k, value in zip(penalised, lse):
                s.follower_log_normalisers[self.position - 1, rows[k][1].slot] = value
        for (_, row), has_nan in zip(rows, nan_rows):
            if has_nan:
                s.fail_slot(row.slot, row.key, ErrorCode.BAD_LOGITS, row.step, self.writer)
        return [row for _, row in rows]
