"""What this test session left behind: its own processes and its own shared-memory files, never the machine's.

Every process the session starts inherits the environment variable :data:`TAG_VARIABLE` (set when this module is
imported, from conftest, before any engine starts), vLLM's engine processes and Ray's workers included, and keeps it
after its parent dies. So "our processes" are the live ones whose environment carries the tag: another program on the
machine, or another test session, is never counted. Our files are those under the names this package gives them in
/dev/shm (sessions ``dual-sampling-*``, staged weights ``dual-sampling.<uid>/``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from pathlib import Path

import psutil

from dual_sampling.lockstep import SESSION_PREFIX
from dual_sampling.lockstep.janitor import SCRATCH_KINDS
from dual_sampling.lockstep.layout import SHM_DIR

TAG_VARIABLE = "DUAL_SAMPLING_TEST_TAG"
TAG = os.environ.setdefault(TAG_VARIABLE, uuid.uuid4().hex)


def tagged_processes() -> set[int]:
    """Live (not zombie) processes started by this test session, at any depth, orphans included."""
    out = set()
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(TAG_VARIABLE) == TAG:
                out.add(p.pid)
    out.discard(os.getpid())
    return out


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


def settled(before: tuple[set[int], set[str]], timeout: float, files_too: bool = True) -> tuple[set[str], set[str]]:
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


__all__ = ["TAG", "TAG_VARIABLE", "describe", "our_shm_files", "settled", "snapshot", "tagged_processes"]
