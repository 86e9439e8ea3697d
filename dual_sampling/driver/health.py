"""The health watch: fail fast when an engine dies, or when nothing moves while requests wait on the engines.

Moving is serving a row, or computing: a step that prefills many long prompts serves no row
for minutes on a CPU while its models keep the cores busy. So the pair is declared stalled
only after ``sync_timeout + STALL_GRACE_S`` seconds in which no engine served a row and no
engine's model processes used ``COMPUTING_CPU_SHARE`` of a core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dual_sampling.lockstep import SyncSession

__all__ = ["HealthWatch", "dead_engine"]

WATCH_S = 0.5
"""How often the engines' processes and progress are checked."""
STALL_GRACE_S = 30.0
"""Beyond sync_timeout, how long no engine may serve a row nor compute while requests are in flight."""
COMPUTING_CPU_SHARE = 0.5
"""The engines' model processes count as computing while they use at least this share of one core."""


def dead_engine(engines: Any) -> str | None:
    """Why an engine of the pair can serve nothing more (its process exited, or vLLM declared it dead), else None.

    After an exception inside a live EngineCore, vLLM raises EngineDeadError to every later
    call while the engine's processes may still be there: its ``errored`` flag says so.
    """
    if engines is None:
        return None
    dead = engines.dead()
    if dead:
        return f"the {dead} engine failed: its engine process exited"
    for name, engine in engines.engines.items():
        if getattr(engine, "errored", False):
            return f"the {name} engine failed: vLLM declared it dead (EngineDeadError)"
    return None


class HealthWatch:
    """Watches one pair on the driver's loop until it fails or the driver closes.

    ``engines()`` returns the pair (None before it starts), ``in_flight()`` the number of
    requests on the engines, ``stopped()`` whether to stop watching, and ``fail(reason)``
    stops the driver for good.
    """

    def __init__(
        self,
        session: SyncSession,
        sync_timeout: float,
        engines: Callable[[], Any],
        in_flight: Callable[[], int],
        stopped: Callable[[], bool],
        fail: Callable[[str], object],
    ) -> None:
        self.session, self.sync_timeout = session, sync_timeout
        self._engines, self._in_flight, self._stopped, self._fail = engines, in_flight, stopped, fail

    async def run(self) -> None:
        last_rows, last_move, last_cpu = None, time.monotonic(), 0.0
        while not self._stopped():
            await asyncio.sleep(WATCH_S)
            engines = self._engines()
            dead = dead_engine(engines)
            if dead:
                self._fail(dead)
                return
            stats = self.session.statistics()
            rows = (*(value for name, value in stats.items() if name.endswith("_rows")), stats["leader_ended"])
            cpu = engines.worker_cpu_seconds() if engines is not None else 0.0
            computing = cpu - last_cpu >= COMPUTING_CPU_SHARE * WATCH_S
            last_cpu = cpu
            in_flight = self._in_flight()
            if rows != last_rows or computing or not in_flight:
                last_rows, last_move = rows, time.monotonic()
            elif time.monotonic() - last_move > self.sync_timeout + STALL_GRACE_S:
                self._fail(
                    f"neither engine served a row or computed for {self.sync_timeout + STALL_GRACE_S:.0f} s "
                    f"({in_flight} requests in flight); an engine stopped responding"
                )
                return
