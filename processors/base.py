"""The vLLM (V1 model runner) logits-processor plugins that put two engines in lockstep.

Each engine loads one subclass of :class:`BaseSyncLogitsProcessor`: the teacher engine
:class:`processors.TeacherSyncLogitsProcessor`, the theta engine
:class:`processors.ThetaSyncLogitsProcessor`. They find their role and the session's
shared-memory name in ``vllm_config.additional_config["dual_sampling"]``, which the driver
passes with ``LLM(..., additional_config=...)``.

Every request carries its pairing key in ``SamplingParams.extra_args["dual_sampling"]``:
``{"slot": int, "key": int, "sampling": RowSampling dict}``. The batch index of a request
is tracked through vLLM's ``BatchUpdate`` (removed, then added, then moved, SWAPs
included); it is never used to pair requests across engines.

At each ``apply(logits)`` a processor handles every tracked row at step
s = len(output_token_ids) (the list in the added tuple is a live reference), and
returns logits in which each row allows exactly the one token decided for it: 0 at that
token, -inf elsewhere. The engines are configured greedy, so both emit that token.

A row whose partner has already finished, failed, or left is *abandoned*: the processor
stops waiting, records why, and forces ``abandon_token_id`` (an EOS) so the engine ends the
request. The driver discards or flags abandoned data; nothing falls back to one model's
logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from dual_sampling.sampling import RowSampling
from dual_sampling.sync import ERR_TIMEOUT, KEY, SyncError, SyncSession

__all__ = ["BaseSyncLogitsProcessor", "TrackedRow", "CONFIG_KEY", "PARK_LIMIT_S"]

CONFIG_KEY = "dual_sampling"
PARK_LIMIT_S = 2.0
"""Longest a processor stays parked at the admission gate; the driver normally opens it within milliseconds."""


@dataclass
class TrackedRow:
    """One request in this engine's persistent batch."""

    slot: int
    key: int
    output_token_ids: list[int]
    """Live reference to the request's generated tokens; its length is the current step."""
    sampling: RowSampling
    alpha: float = 0.5
    """Last α of this request (teacher side), the warm start of the next solve."""

    @property
    def step(self) -> int:
        return len(self.output_token_ids)


class BaseSyncLogitsProcessor(LogitsProcessor):
    """Shared bookkeeping: session attach, BatchUpdate tracking, blocking waits, forcing tokens."""

    role: ClassVar[str] = ""
    released_word: ClassVar[int] = -1
    """Slot control word this side sets when a request leaves its batch."""
    parked_stat_word: ClassVar[int | None] = None
    """Header word that accumulates this side's time parked at the admission gate (ns), if any."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        config = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
        if not config:
            raise ValueError(
                f"{type(self).__name__} needs LLM(..., additional_config={{'{CONFIG_KEY}': {{...}}}}) "
                "naming the session; build engines through dual_sampling.OptimalSamplingDual"
            )
        if config.get("role") != self.role:
            raise ValueError(f"{type(self).__name__} is the {self.role} processor but the engine's role is {config.get('role')!r}")
        self.config = config
        self.session = SyncSession.attach(config["session"])
        self.vocab = self.session.layout.vocab
        self.sync_timeout = float(config["sync_timeout"])
        self.abandon_token_id = int(config["abandon_token_id"])
        self.rows: dict[int, TrackedRow] = {}

    # ------------------------------------------------------------------ vLLM interface

    def is_argmax_invariant(self) -> bool:
        # Forcing a token changes the argmax: this processor must run for greedy requests too.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._release(self.rows.pop(index, None))
        for index, params, _prompt_ids, output_ids in batch_update.added:
            self._release(self.rows.pop(index, None))
            args = (getattr(params, "extra_args", None) or {}).get(CONFIG_KEY)
            if args is None:
                raise SyncError(f"a request reached the {self.role} engine without a dual_sampling pairing key")
            self.rows[index] = TrackedRow(int(args["slot"]), int(args["key"]), output_ids, RowSampling.from_dict(args["sampling"]))
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if direction == MoveDirectionality.SWAP:
                if row_a is not None:
                    self.rows[b] = row_a
                if row_b is not None:
                    self.rows[a] = row_b
            else:
                # One-way move a -> b; whatever sat at b was already removed.
                self._release(row_b)
                if row_a is not None:
                    self.rows[b] = row_a

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        batch = [(i, row) for i, row in sorted(self.rows.items()) if i < logits.shape[0]]
        if not batch:
            return logits
        decided = self.synchronise(logits, batch)
        # The step is decided: if the driver is admitting requests, wait here so that both engines take them in at once.
        parked_s = self.session.park_if_held(self.role, PARK_LIMIT_S)
        if parked_s and self.parked_stat_word is not None:
            self.session.header[self.parked_stat_word] += int(parked_s * 1e9)
        return self._force(logits, decided)

    # ------------------------------------------------------------------ for subclasses

    def synchronise(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        """Return {batch index: token id} for every row in ``batch``."""
        raise NotImplementedError

    def owns(self, row: TrackedRow) -> bool:
        """The slot still belongs to this request (the driver never reuses it before both sides release it)."""
        return int(self.session.control[row.slot, KEY]) == row.key

    def time_out(self, pending: dict[int, TrackedRow], decided: dict[int, int], stat_word: int) -> None:
        """Fail every row still pending after ``sync_timeout``: flag its slot and abandon it."""
        for i, row in pending.items():
            self.session.fail_slot(row.slot, ERR_TIMEOUT, row.step)
            decided[i] = self.abandon_token_id
        self.session.header[stat_word] += len(pending)

    def wait(self, bell: int, seen: int, deadline: float) -> None:
        self.session.wait_bell(bell, seen, min(deadline - time.monotonic(), 0.05))

    # ------------------------------------------------------------------ helpers

    def _release(self, row: TrackedRow | None) -> None:
        # The driver may already have read and closed the slot (key 0); it cannot have reopened
        # it for another request, since that needs this side's release first.
        if row is not None and int(self.session.control[row.slot, KEY]) in (row.key, 0):
            self.session.control[row.slot, self.released_word] = 1

    def _force(self, logits: torch.Tensor, decided: dict[int, int]) -> torch.Tensor:
        index = torch.tensor(list(decided), dtype=torch.long, device=logits.device)
        tokens = torch.tensor(list(decided.values()), dtype=torch.long, device=logits.device)
        logits[index] = -float("inf")
        logits[index, tokens] = 0.0
        return logits
