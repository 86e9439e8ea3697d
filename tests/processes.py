"""What this test session left behind: its own processes and its own shared-memory files, never the machine's.

Every process the session starts inherits the environment variable :data:`TAG_VARIABLE` (set when this module is
imported, from conftest, before any engine starts), vLLM's engine processes and Ray's workers included, and keeps it
after its parent dies. But /proc shows a vLLM engine process's environment as empty once it has set its title
(``VLLM::EngineCore``, ``VLLM::Worker``): the tag alone missed exactly the processes the fault tests are about. So
"our processes" are those :data:`LINEAGE` has seen with the tag or born to one of ours, recorded from this module's
import on: another program on the machine, or another test session, is never counted. Our files are those under
the names this package gives them in /dev/shm (sessions ``dual-sampling-*``, staged weights
``dual-sampling.<uid>/``).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
from pathlib import Path

import psutil

from dual_sampling.lockstep import SESSION_PREFIX
from dual_sampling.lockstep.janitor import SCRATCH_KINDS
from dual_sampling.lockstep.layout import SHM_DIR
from tests.budget import SETTLE_S

TAG_VARIABLE = "DUAL_SAMPLING_TEST_TAG"
TAG = os.environ.setdefault(TAG_VARIABLE, uuid.uuid4().hex)


class _Lineage:
    """Every process this session started, by pid and start time: one whose environment carries the tag, or whose
    parent is one already known. vLLM's engine processes need the second way: setting a process title overwrites the
    environment that /proc shows (EngineCore's and Worker's read back empty). Scanned twice a second from this
    module's import on (an engine lives for seconds at the least, its parent as long), and again at each query."""

    def __init__(self) -> None:
        self.known: dict[int, float] = {}
        self.engine_cores: set[tuple[int, float]] = set()
        """Those of them that became a vLLM engine core (the title comes after the start)."""
        self._lock = threading.Lock()
        threading.Thread(target=self._poll, name="test-process-lineage", daemon=True).start()

    def _poll(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.scan()
            time.sleep(0.5)

    def scan(self) -> list[tuple[psutil.Process, dict]]:
        """Record the new processes of ours; return every live process seen, with its ppid, create_time, status and
        name."""
        # as_dict, not process_iter's attrs: those land on psutil's shared Process objects (``.info``), which a scan
        # in another thread, or any caller's process_iter, may overwrite with other keys meanwhile.
        procs = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                info = p.as_dict(["ppid", "create_time", "status", "name"])
                if info["create_time"] is not None:  # unreadable: never taken for ours
                    procs.append((p, info))
        with self._lock:
            alive = {p.pid: info["create_time"] for p, info in procs}
            names = {p.pid: info["name"] or "" for p, info in procs}
            added = True
            while added:  # until nothing new: a child may be listed before its parent (start times tie at 10 ms)
                added = False
                for p, info in procs:
                    pid, ppid = p.pid, info["ppid"]
                    if self.known.get(pid) == info["create_time"]:
                        # A worker forked from its EngineCore bears the core's title until it sets its own.
                        core = (info["name"] or "").startswith("VLLM::EngineCor")
                        if core and not names.get(ppid, "").startswith("VLLM::EngineCor"):
                            self.engine_cores.add((pid, info["create_time"]))
                        continue
                    if pid == os.getpid():
                        continue
                    parent_ours = ppid == os.getpid() or (ppid in self.known and self.known[ppid] == alive.get(ppid))
                    tagged = False
                    if not parent_ours:
                        with contextlib.suppress(psutil.Error):
                            tagged = p.environ().get(TAG_VARIABLE) == TAG
                    if parent_ours or tagged:
                        self.known[pid] = info["create_time"]
                        added = True
        return procs

    def engine_starts(self) -> int:
        """vLLM engine cores among our processes so far, live or gone."""
        self.scan()
        with self._lock:
            return len(self.engine_cores)

    def live(self) -> list[psutil.Process]:
        """Our live (not zombie) processes, at any depth, orphans included."""
        procs = self.scan()
        with self._lock:
            return [
                p
                for p, info in procs
                if self.known.get(p.pid) == info["create_time"] and info["status"] != psutil.STATUS_ZOMBIE
            ]


LINEAGE = _Lineage()


def tagged_processes() -> set[int]:
    """Live (not zombie) processes started by this test session, at any depth, orphans included."""
    return {p.pid for p in LINEAGE.live()}


_OWNER_PID = re.compile(
    r"(?:" + "|".join([re.escape(SESSION_PREFIX), *(f"{kind}-" for kind in SCRATCH_KINDS)]) + r")(?P<pid>\d+)-"
)
"""The pid in a session file's name, a listing's, or a scratch folder's: the process that made it."""


def _another_programs(name: str) -> bool:
    """Whether the file ``name`` was made by a live process this session did not start (another test session's)."""
    m = _OWNER_PID.match(Path(name).name)
    if m is None or int(m["pid"]) == os.getpid():
        return False
    try:
        return psutil.Process(int(m["pid"])).environ().get(TAG_VARIABLE) != TAG
    except psutil.Error:
        return False  # gone: what it left counts as ours (a dead neighbour's files are rare, ours matter)


def our_shm_files() -> set[str]:
    """Our entries in /dev/shm, and the files inside our listing and scratch folders (relative paths); files made by
    a live process that is not ours (another test session's) are left out."""
    out = set()
    for entry in SHM_DIR.iterdir():
        if entry.name.startswith(SESSION_PREFIX.rstrip("-")):
            out.add(entry.name)
            if entry.is_dir():
                with contextlib.suppress(OSError):
                    out |= {str(p.relative_to(SHM_DIR)) for p in entry.rglob("*")}
    return {name for name in out if not any(_another_programs(part) for part in Path(name).parts)}


def snapshot() -> tuple[set[int], set[str]]:
    return tagged_processes(), our_shm_files()


def describe(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:80]}"
    return f"{pid} (gone)"


def settled(
    before: tuple[set[int], set[str]], timeout: float = SETTLE_S, files_too: bool = True
) -> tuple[set[str], set[str]]:
    """New processes (as "pid command") and new files of ours, once none is left or ``timeout`` passed. The wait is a
    deadline for cleanup that runs on its own (an engine's exit), not a measurement. ``files_too=False`` waits for
    the processes alone (files a later cleanup is to remove would otherwise hold the wait to its deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        procs, files = snapshot()
        new_procs, new_files = procs - before[0], files - before[1]
        if (not new_procs and (not new_files or not files_too)) or time.monotonic() > deadline:
            return {describe(p) for p in new_procs}, new_files
        time.sleep(0.2)


class EngineStarts:
    """Counts the vLLM engines this session starts (their ``VLLM::EngineCore`` processes, in-process and in
    subprocesses alike), for the terminal summary: engine starts and stops are most of the suite's time, so their
    count says what a faster suite has to cut."""

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(f"vLLM engines started by this session: {LINEAGE.engine_starts()}")


__all__ = [
    "LINEAGE",
    "TAG",
    "TAG_VARIABLE",
    "EngineStarts",
    "describe",
    "our_shm_files",
    "settled",
    "snapshot",
    "tagged_processes",
]
