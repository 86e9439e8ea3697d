"""The lockstep logits processors' common part: one logits row and one token per request per step.

Each engine loads one subclass of :class:`BaseSyncLogitsProcessor`: the leader's engine
:class:`processors.LeaderLogitsProcessor`, each follower's
:class:`processors.FollowerLogitsProcessor`. Which requests run at each step is not
their business: the schedulers (``processors.scheduler``) make every engine run the same
requests at every step. The processors only move data for those requests.

Every request carries its pairing in ``SamplingParams.extra_args["dual_sampling"]``
(:class:`dual_sampling.lockstep` has the slot words). The batch index of a request is
tracked by the model runner's seam (:class:`processors.model_runner.BatchRowsProcessor`);
it is never used to pair requests across engines.

At each step a processor handles every tracked row at step
s = len(output_token_ids) (the runner's live list of the request's tokens) and returns
logits in which each row allows exactly the one token decided for it. Both engines run
greedy, so every engine emits that token.

A row whose request has failed (an error in its slot, from any engine) or whose session
shut down is *abandoned*: the processor stops waiting and forces a filler token, one that
is no stop token of the request, so the engine does not end the request on its own. The
leader scheduler ends failed requests on every engine at the next step boundary; the
driver marks their samples failed. Nothing ever falls back to one model's logits. An
exception in the work for one row fails that row's request alone (``decision_error``,
logged once): an exception escaping ``apply`` would kill the EngineCore with every request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.lockstep import CONFIG_KEY, Bell, ErrorCode, LockstepConfig, Slot, SyncError, SyncSession, Writer
from dual_sampling.lockstep.row_channel import RowChannel, open_row_channel
from processors.model_runner import BatchRowsProcessor

__all__ = ["WAIT_CAP_S", "BaseSyncLogitsProcessor", "TrackedRow", "check_roster", "request_pairing"]

logger = logging.getLogger(__name__)

WAIT_CAP_S = 0.05
"""Longest single futex wait: shutdowns and errors without a wake are seen within it."""


def request_pairing(params: Any, model: str) -> dict:
    """The ``extra_args`` pairing of one request; raise SyncError if it has none (it was not built by the driver)."""
    args = (getattr(params, "extra_args", None) or {}).get(CONFIG_KEY)
    if args is None or "slot" not in args or "key" not in args:
        raise SyncError(f"a request reached the {model} engine without a dual_sampling pairing (slot and key)")
    return args


def check_roster(config: LockstepConfig, session: SyncSession) -> None:
    """Refuse an engine whose roster does not have the session's model count (its words would lie elsewhere)."""
    if len(config.roster) != session.layout.models:
        raise SyncError(
            f"roster {config.roster} names {len(config.roster)} models; the session {session.name} holds "
            f"{session.layout.models}"
        )


@dataclass
class TrackedRow:
    """One request in this engine's persistent batch."""

    slot: int
    key: int
    output_token_ids: list[int]
    """Live reference to the request's generated tokens; its length is the current step."""
    sampling: RowSampling
    alpha: Any = 0.5
    """Last α of this request (the leader's side; a list of one per teacher with several), the warm start of the
    next solve."""
    participants: int = -1
    """The roster positions whose engines run this request, one bit each (:attr:`Slot.PARTICIPANTS`); -1: all."""
    filler: int = field(init=False)
    """Token forced when the row is abandoned: never one of the request's stop tokens."""

    def __post_init__(self) -> None:
        stops = set(self.sampling.stop_token_ids)
        self.filler = next(t for t in range(len(stops) + 1) if t not in stops)

    @property
    def step(self) -> int:
        return len(self.output_token_ids)


class BaseSyncLogitsProcessor(BatchRowsProcessor[TrackedRow]):
    """Shared bookkeeping: session attach, the batch's rows, blocking waits, forcing tokens."""

    leads: ClassVar[bool]
    """The leader's processor (it decides), or a follower's."""

    def attach(self, vllm_config: Any, device: torch.device) -> None:
        self.config = LockstepConfig.from_vllm(vllm_config, self.leads, type(self).__name__)
        self.role = self.config.role
        self.position = self.config.position
        self.writer = Writer.PROCESSOR.at(self.position)
        self.session = SyncSession.attach(self.config.session)
        check_roster(self.config, self.session)
        self.session.names = self.config.roster
        self.vocab = self.session.layout.vocab
        self.sync_timeout = self.config.sync_timeout
        s = self.session
        if self.config.row_transport == "device" and s.layout.followers > 1:
            raise ValueError(
                f"row_transport='device' shares one follower's rows buffer; this session has {s.layout.followers} "
                "followers: use 'pinned'"
            )
        # Opened as the engine starts, so a transport that cannot work fails the start, not the first step: the
        # leader's side of the device transport makes the buffer, the follower's waits (up to sync_timeout) for it.
        followers = range(s.layout.followers) if self.leads else [self.position - 1]
        self.row_channels: list[RowChannel] = [
            open_row_channel(
                self.config.row_transport,
                self.role,
                s.follower_logprobs[f],
                device,
                s.rows_handle_path,
                self.sync_timeout,
                leads=self.leads,
            )
            for f in followers
        ]
        """How each follower's rows reach the leader (``lockstep.row_channel``): the leader's, one per follower; a
        follower's, its own alone."""

    # ------------------------------------------------------------------ the model runner's seam

    def track(self, params: Any, output_token_ids: list[int]) -> TrackedRow:
        pairing = request_pairing(params, self.role)
        slot, key = int(pairing["slot"]), int(pairing["key"])
        row = TrackedRow(slot, key, output_token_ids, RowSampling.from_dict(pairing["sampling"]))
        if abs(int(self.session.control[slot, Slot.KEY])) == key:  # else the request is gone: its row is abandoned
            row.participants = int(self.session.control[slot, Slot.PARTICIPANTS])
        return row

    def untrack(self, row: TrackedRow) -> None:
        self.session.release(row.slot, row.key, self.position)

    def process(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> torch.Tensor:
        try:
            decided = self.synchronise(logits, batch)
        except Exception:
            # An exception escaping here would kill the EngineCore and every request with it: only this
            # step's requests fail (the per-row work already catches what one request's settings cause).
            logger.exception("the %s processor failed a step; its %d requests fail", self.role, len(batch))
            decided = {}
            for i, row in batch:
                self.session.fail_slot(row.slot, row.key, ErrorCode.DECISION_ERROR, row.step, self.writer)
                decided[i] = row.filler
        return self._force(logits, decided)

    # ------------------------------------------------------------------ for subclasses

    def synchronise(self, logits: torch.Tensor, batch: list[tuple[int, TrackedRow]]) -> dict[int, int]:
        """Return {batch index: token id} for every row in ``batch``."""
        raise NotImplementedError

    def abandoned(self, row: TrackedRow) -> bool:
        """Stop serving this row: its slot is no longer its own, it failed, or the session shut down."""
        c = self.session.control[row.slot]
        return int(c[Slot.KEY]) != row.key or int(c[Slot.ERROR]) != 0 or self.session.is_shut_down

    def time_out(self, pending: dict[int, TrackedRow], decided: dict[int, int]) -> None:
        """Fail every row still pending after ``sync_timeout`` and abandon it."""
        for i, row in pending.items():
            self.session.fail_slot(row.slot, row.key, ErrorCode.SYNC_TIMEOUT, row.step, self.writer)
            decided[i] = row.filler

    def _fail_row(self, row: TrackedRow, work: str) -> None:
        """Inside an ``except`` block: log the exception once and fail this row's request alone."""
        logger.exception(
            "the %s processor failed %s (slot %d, request key %d, step %d); that request fails as %s",
            self.role,
            work,
            row.slot,
            row.key,
            row.step,
            ErrorCode.DECISION_ERROR.label,
        )
        self.session.fail_slot(row.slot, row.key, ErrorCode.DECISION_ERROR, row.step, self.writer)

    def wait(self, bell: Bell, seen: int, deadline: float) -> None:
        self.session.wait_bell(bell, seen, min(deadline - time.monotonic(), WAIT_CAP_S))

    # ------------------------------------------------------------------ helpers

    def _force(self, logits: torch.Tensor, decided: dict[int, int]) -> torch.Tensor:
        index = torch.tensor(list(decided), dtype=torch.long, device=logits.device)
        tokens = torch.tensor(list(decided.values()), dtype=torch.long, device=logits.device)
        logits[index] = -float("inf")
        logits[index, tokens] = 0.0
        return logits
