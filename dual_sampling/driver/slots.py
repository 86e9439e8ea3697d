"""The session's slots, handed to requests first come first served, and the gate that stops handing them out.

A slot is free when the driver holds it for no request and both engines have let its last
request go (:meth:`SyncSession.slot_free`). Slots free up as the engines release them, so a
request that finds none waits in line and a feeder task looks again every few milliseconds.
The gate closes for a weight update (``updating``) or a pause (``paused``): no slot is handed
out, and :meth:`SlotPool.drain` waits until none is held.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from dual_sampling.lockstep import SyncSession

__all__ = ["SlotPool"]

SLOT_POLL_S = 0.005
"""How often a request waiting for a slot, or a drain, looks again."""


class SlotPool:
    """Slots of one session, held by the driver's requests; runs on the driver's loop only."""

    def __init__(self, session: SyncSession) -> None:
        self.session = session
        self.held: set[int] = set()
        """Slots handed to a request and not yet released."""
        self.updating = False
        """While set, no slot is handed out: an update waits for the engines to run no request."""
        self.paused = False
        """Set by a pause until its resume: no slot is handed out (requests wait for one)."""
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._feeder: asyncio.Task | None = None

    @property
    def gate_closed(self) -> bool:
        return self.updating or self.paused

    async def acquire(self, waiter: asyncio.Future) -> int | None:
        """A free slot, first come first served; None if the request was aborted meanwhile (``waiter`` set to None)."""
        slot = None if self._waiters or self.gate_closed else self._free_slot()
        if slot is not None:
            self.held.add(slot)
            return slot
        self._waiters.append(waiter)
        if self._feeder is None or self._feeder.done():
            self._feeder = asyncio.create_task(self._feed())
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self.held.discard(waiter.result())
            raise

    def release(self, slot: int) -> None:
        """Give ``slot`` back (the engines may still hold it: it is free again once they let go)."""
        self.held.discard(slot)

    async def drain(self, each_poll: Callable[[], None]) -> None:
        """Wait until no slot is held (no request on either engine), calling ``each_poll`` before every look.

        ``each_poll`` may raise to end the wait (a failed pair) or abort the requests in flight.
        """
        while self.held:
            each_poll()
            await asyncio.sleep(SLOT_POLL_S)

    def _free_slot(self) -> int | None:
        for slot in range(self.session.layout.slots):
            if slot not in self.held and self.session.slot_free(slot):
                return slot
        return None

    async def _feed(self) -> None:
        while self._waiters:
            while self._waiters and self._waiters[0].done():
                self._waiters.popleft()  # cancelled while waiting
            slot = self._free_slot() if self._waiters and not self.gate_closed else None
            if slot is None:
                await asyncio.sleep(SLOT_POLL_S)
                continue
            self.held.add(slot)
            self._waiters.popleft().set_result(slot)
