"""The theta engine's processor: publish theta's log-probability row, then force the teacher's token."""

from __future__ import annotations

import time

import torch

from dual_sampling.sync import (
    BELL_TO_TEACHER, BELL_TO_THETA, ERR_BAD_LOGITS, ERR_NONE, ERROR, STAT_THETA_ABANDONED,
    STAT_THETA_CALLS, STAT_THETA_ROWS, STAT_THETA_TIMEOUTS, STAT_THETA_WAIT_NS, TEACHER_FINISHED, TEACHER_RELEASED,
    TEACHER_STEP, THETA_RELEASED, THETA_STEP, TOKEN,
)
from processors.base import BaseSyncLogitsProcessor, TrackedRow

__all__ = ["ThetaSyncLogitsProcessor"]


class ThetaSyncLogitsProcessor(BaseSyncLogitsProcessor):
    """Theta side: one row copy out per step, one token id in; it never samples."""

    role = "theta"
    released_word = THETA_RELEASED

    def synchronise(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        s = self.session
        control = s.control
        owned = [(i, row) for i, row in batch if self.owns(row)]
        decided = {i: self.abandon_token_id for i, row in batch if not self.owns(row)}
        if owned:
            index = torch.tensor([i for i, _ in owned], dtype=torch.long, device=logits.device)
            slots = [row.slot for _, row in owned]
            # Normalised here, on theta's cores, while the teacher is still busy with its own model.
            rows = torch.log_softmax(logits[index, : self.vocab].float(), dim=-1).cpu()
            # NaN or +inf anywhere in a row makes its whole log-softmax NaN; so does a row with nothing finite.
            nan_rows = torch.isnan(rows[:, 0]).tolist()
            # All rows in one copy; the step words are written after the data they announce.
            s.theta_logprobs[slots] = rows.numpy()
            for (_, row), has_nan in zip(owned, nan_rows):
                if has_nan:
                    s.fail_slot(row.slot, ERR_BAD_LOGITS, row.step)
                control[row.slot, THETA_STEP] = row.step
            s.ring(BELL_TO_TEACHER)
            s.header[STAT_THETA_ROWS] += len(owned)
        s.header[STAT_THETA_CALLS] += 1

        pending = dict(owned)
        start = time.monotonic()
        deadline = start + self.sync_timeout
        while pending:
            seen = s.bell_value(BELL_TO_THETA)
            for i, row in list(pending.items()):
                c = control[row.slot]
                if not self.owns(row):
                    decided[i] = self.abandon_token_id
                elif c[TEACHER_STEP] == row.step:
                    decided[i] = int(c[TOKEN])
                elif c[ERROR] != ERR_NONE or c[TEACHER_FINISHED] or c[TEACHER_RELEASED] or s.is_shut_down:
                    decided[i] = self.abandon_token_id
                    s.header[STAT_THETA_ABANDONED] += 1
                else:
                    continue
                del pending[i]
            if not pending:
                break
            if time.monotonic() >= deadline:
                self.time_out(pending, decided, STAT_THETA_TIMEOUTS)
                break
            self.wait(BELL_TO_THETA, seen, deadline)
        s.header[STAT_THETA_WAIT_NS] += int((time.monotonic() - start) * 1e9)
        return decided
