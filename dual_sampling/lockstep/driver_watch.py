"""An engine process's watch on its driver: once the driver is gone, the engine removes what it maps and exits.

A driver killed outright (SIGKILL, a cluster manager) runs no cleanup, and its engines would wait on it for ever (or
for vLLM's start-up handshake timeout, minutes, if it died before they were up). So every engine process watches the
driver's pid itself: a forked EngineCore and its worker from their first line (``driver.engine_start``), a spawned
one from its scheduler's start (``processors.scheduler``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from dual_sampling.lockstep.janitor import mapped_shm_files, pid_alive
from dual_sampling.lockstep.layout import SESSION_PREFIX, SHM_DIR

__all__ = ["DRIVER_POLL_S", "exit_orphaned", "watch_driver"]

logger = logging.getLogger(__name__)

DRIVER_POLL_S = 1.0
"""How often an engine process checks that its driver is still alive (seconds)."""


def watch_driver(pid: int, needed: Callable[[], bool] = lambda: True) -> None:
    """In an engine process: exit it (and its children) once driver ``pid`` is gone, from a daemon thread polling
    every :data:`DRIVER_POLL_S`, unless ``needed()`` says the watch is over. An engine whose driver was killed would
    otherwise wait on it for ever, or until vLLM's start-up handshake times out (minutes)."""

    def run() -> None:
        while needed():
            time.sleep(DRIVER_POLL_S)
            if needed() and not pid_alive(pid):
                logger.error("the dual-sampling driver (pid %d) is gone; stopping this engine process", pid)
                exit_orphaned()

    threading.Thread(target=run, name="dual-sampling-driver-watch", daemon=True).start()


def exit_orphaned() -> None:
    """Remove the /dev/shm files this process and its children map, SIGKILL the children, then this process.

    The driver is gone, so nothing else uses those files, and files made after its death (an engine still starting
    keeps making them) are in no listing a later session could read. Session files are left to the next session's
    cleanup, which knows their owner is dead.
    """
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for name in mapped_shm_files([os.getpid(), *(c.pid for c in children)]):
            if not name.startswith(SESSION_PREFIX):
                (SHM_DIR / name).unlink(missing_ok=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
