"""The engines' processes, seen from the driver: finding them and their shared-memory files, reaping them, and
binding their model threads to CPUs."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from dual_sampling.lockstep import SESSION_PREFIX, SHM_DIR, mapped_shm_files, process_start_time
from dual_sampling.roster import PAIR

__all__ = [
    "await_new_child",
    "children",
    "descendants",
    "engine_cpus",
    "engine_shm_files",
    "environment",
    "reap",
    "remove_engine_file",
    "semaphore_files",
    "spawned_children",
    "split_cpu_binding",
]

logger = logging.getLogger(__name__)


def engine_shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files ``pids`` map that close() removes: not the session's, and not semaphores.

    A semaphore may be shared with this process, whose own exit unlinks it (and complains if
    the name has gone).
    """
    return {name for name in mapped_shm_files(pids) if not name.startswith((SESSION_PREFIX, "sem."))}


SHARED_MEMORY_PREFIX = "psm_"
"""How multiprocessing names a ``SharedMemory`` segment it names itself (vLLM's message queues between an EngineCore
and its worker are such segments)."""


def remove_engine_file(name: str) -> None:
    """Remove an engine's /dev/shm file left after its processes died. A ``SharedMemory`` segment an engine created is
    registered with this process's resource tracker (an engine's processes start from this one, spawned or forked
    from its fork server, and share its tracker) until its creator unlinks it; one whose creator died holding it
    stays registered, so once its file is removed here the tracker must forget it, or at exit it warns of leaked
    shared_memory objects and fails to unlink files that are gone."""
    path = SHM_DIR / name
    if not path.exists():
        return
    path.unlink(missing_ok=True)
    if name.startswith(SHARED_MEMORY_PREFIX):
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + name, "shared_memory")


def semaphore_files() -> set[str]:
    """Names of the multiprocessing semaphores in /dev/shm now."""
    return {path.name for path in SHM_DIR.glob("sem.mp-*")}


def reap(pids: list[int], timeout: float) -> None:
    """SIGTERM ``pids``, wait up to ``timeout`` s for them to exit, and SIGKILL the ones still there.

    Called once vLLM's own shutdown has stopped every process it knew alive, so a process still
    running is one it lost track of: vLLM tells a forked EngineCore's life from its fork server, and
    a cluster manager may kill that server first (Ray kills an exiting actor's children), leaving the
    EngineCore idle. A second SIGTERM to a process already stopping is ignored (vLLM's handlers).

    Each pid stands for the process it names on entry (its start time): once that process has
    exited, its pid may name an unrelated one, which is never signalled.
    """
    started = {pid: start for pid in pids if (start := process_start_time(pid)) is not None}

    def running() -> list[int]:
        return [pid for pid, start in started.items() if process_start_time(pid) == start]

    for pid in running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in running():
        logger.warning("engine process %d did not exit; killing it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)


def spawned_children() -> set[int]:
    """Pids of this process's children started by multiprocessing's spawn (engine processes)."""
    import psutil

    out = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                out.add(child.pid)
    return out


def children() -> set[int]:
    """Pids of this process's children (an EngineCore renames itself, so its command line can't tell it)."""
    import psutil

    return {child.pid for child in psutil.Process().children()}


def descendants(pids: Iterable[int]) -> list[int]:
    """``pids`` and all their descendants that are alive now."""
    import psutil

    roots = list(pids)
    out = list(roots)
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return out


def await_new_child(known: set[int], future: Any, timeout: float = 120.0) -> None:
    """Wait until an engine process beyond ``known`` exists (its environment is then fixed), or the start ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not future.done() and not (spawned_children() - known):
        time.sleep(0.02)


def split_cpu_binding(names: Sequence[str] = PAIR.names, loads: Sequence[float] | None = None) -> dict[str, str]:
    """{model name: CPU list} for vLLM's CPU backend: the CPUs split into as many runs as there are engines (``names``,
    in roster order; a pair: the teacher's model gets the first half, theta's the rest). With more engines than CPUs,
    one run per CPU, and the engines placed so that the busiest CPU has the least work: the largest ``loads`` (say,
    each model's weight bytes; None: equal) first, each on the CPU with the least so far.

    vLLM binds every engine's model threads to the same cores of NUMA node 0 and leaves
    one core to its scheduler process; two engines would then time-share those cores
    while the others idle. Empty (vLLM's own binding applies) when not on the CPU backend,
    when the user set VLLM_CPU_OMP_THREADS_BIND, or with fewer than two CPUs.
    """
    from vllm.platforms import current_platform

    cpus = sorted(os.sched_getaffinity(0))
    if not current_platform.is_cpu() or len(cpus) < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    runs = min(len(names), len(cpus))
    size, extra = divmod(len(cpus), runs)
    starts = [i * size + min(i, extra) for i in range(runs + 1)]  # the first ``extra`` runs take one CPU more
    groups = [",".join(map(str, cpus[starts[i] : starts[i + 1]])) for i in range(runs)]
    if runs == len(names):
        return dict(zip(names, groups))
    weights = list(loads) if loads is not None else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"loads must give one load per engine ({len(names)}), got {len(weights)}")
    work, placed = [0.0] * runs, {}
    for i in sorted(range(len(names)), key=lambda i: -weights[i]):  # largest first (stable: roster order on ties)
        run = min(range(runs), key=lambda r: work[r])
        work[run] += weights[i]
        placed[names[i]] = groups[run]
    return {name: placed[name] for name in names}


def engine_cpus(cpu_list: str | None) -> contextlib.AbstractContextManager[None]:
    """Build a vLLM engine inside this block to bind its model threads to ``cpu_list`` ("0,1"; None: vLLM's choice).

    The engine's processes read VLLM_CPU_OMP_THREADS_BIND when they are spawned.
    """
    return environment({"VLLM_CPU_OMP_THREADS_BIND": cpu_list})


@contextlib.contextmanager
def environment(variables: dict[str, str | None]) -> Iterator[None]:
    """Set each environment variable of ``variables`` to its value inside this block (None: leave it as it is)."""
    old = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
