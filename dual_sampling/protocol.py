"""The shared memory of one dual-engine session: its layout, who writes what, and the waits.

One session is one file in /dev/shm, mapped by the driver and by four plugins inside the
two engines: each engine's scheduler (``processors.scheduler``, in the EngineCore process)
and each engine's logits processor (``processors.teacher`` / ``processors.theta``, in the
worker process). It holds:

- a header: sizes, the owner's pid, the shutdown word, plan counters and statistics;
- doorbells: 32-bit futex words, one per direction of waiting;
- the plan ring: the teacher scheduler's list of request keys for each engine step;
- per request *slot*: control words (:class:`Slot`), theta's log-probability row for the
  current step, the per-token records the teacher processor writes, and (for requests that
  ask) q's most likely tokens at each step.

Roles and the words they write (:data:`WRITERS` is the table; ``docs/architecture.md`` has
the argument for why lockstep holds):

- the **driver** opens and closes slots and asks for aborts;
- the **teacher scheduler** (the leader) decides every change of batch membership: it
  admits, publishes each step's plan, and ends requests (aborts, stop strings, errors);
- the **theta scheduler** (the follower) marks arrivals and runs exactly each plan;
- the **processors** exchange one logits row and one token per request per step.

Every flag that a late writer could leave behind carries the request key it refers to,
so it can never mark a slot's next occupant. Doorbells are rung by *storing* a fresh
value (the writer's id and a counter), never by a read-modify-write, so several writers
cannot lose a wake. Waits block on a futex (Linux) with a cap, so a shutdown is seen
within the cap even without a wake. Lockstep relies on stores becoming visible in program
order, which x86-64 guarantees; on other architectures :meth:`SyncSession.create` refuses
to start rather than run without fences.

Cleanup after a crash (:func:`cleanup_stale_sessions`, run by every :meth:`SyncSession.create`)
acts only on this user's regular files, never follows a symlink, and removes from a listing
only names of the shared-memory segments engines make. A session's header carries its
driver's boot, PID namespace and start time; a session of another PID namespace (a container
sharing /dev/shm) is left alone, since its driver's liveness cannot be seen from here: only a
session of its own namespace removes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import logging
import mmap
import os
import platform
import re
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from stat import S_IMODE, S_ISDIR, S_ISLNK, S_ISREG

import numpy as np

__all__ = [
    "PLAN_RING",
    "RECORD_FIELDS",
    "SESSION_PREFIX",
    "SHM_DIR",
    "TOP_LOGPROBS_MAX",
    "WRITERS",
    "Bell",
    "ErrorCode",
    "Finish",
    "Header",
    "Phase",
    "SessionLayout",
    "Slot",
    "Stat",
    "SyncError",
    "SyncSession",
    "Writer",
    "check_host",
    "cleanup_stale_sessions",
    "listing_dir",
    "mapped_shm_files",
    "pid_alive",
    "process_start_time",
    "segments_listing",
    "session_owners",
    "write_listing",
]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SESSION_PREFIX = "dual-sampling-"
_LISTING_DIR_PREFIX = "dual-sampling."
"""This user's listing directory is ``<shm dir>/dual-sampling.<uid>`` (no session name starts so)."""
_SESSION_NAME = re.compile(re.escape(SESSION_PREFIX) + r"(?P<pid>\d+)-[0-9a-f]+")
_LISTING_NAME = re.compile(r"(?P<session>" + _SESSION_NAME.pattern + r")\.segments(?P<tmp>\.tmp)?")
_LISTED_NAME = re.compile(
    r"psm_[0-9A-Za-z_]+"  # multiprocessing.shared_memory (vLLM's message queues and buffers)
    r"|sem\.mp-[0-9a-z_]+"  # multiprocessing's named semaphores
    r"|torch_\d+_\d+_\d+"  # torch's file_system sharing strategy
    r"|vllm_[0-9A-Za-z_-]+\.mmap"  # vLLM's CPU KV-offload and encoder-cache regions
)
"""Names a listing may hold: the shared-memory segments engines create. No '/', no '..', no NUL."""
_MiB = 1 << 20
_MAGIC = 0x44554132  # "DUA2"; a session written by an older layout is refused, never misread
PLAN_RING = 4
"""Plans kept at once. The leader is at most one plan ahead of the follower (its step needs theta's rows)."""
RECORD_FIELDS = ("alpha", "logp_teacher", "logp_theta", "logq")
"""Columns of the per-token records (float32), in order."""
TOP_LOGPROBS_MAX = 20
"""Most likely tokens of q recorded per token at most, for requests that ask (OpenAI's limit)."""


class SyncError(RuntimeError):
    """The two engines could not be kept in lockstep, or an engine failed."""


class Header(IntEnum):
    """Header words (int64)."""

    MAGIC = 0
    VOCAB = 1
    SLOTS = 2
    MAX_STEPS = 3
    PLAN_WIDTH = 4
    OWNER_PID = 5
    """The driver's pid: engines exit when it dies; the next session removes the file."""
    SHUTDOWN = 6
    """Non-zero: every wait ends and every row is abandoned."""
    PLANS_PUBLISHED = 7
    """Teacher scheduler: plans published so far (the next plan's number)."""
    PLANS_CONSUMED = 8
    """Theta scheduler: plans it has run so far."""
    THETA_PUBLICATIONS = 9
    """Theta processor: a sequence word, odd while it stores one step's rows and step words, even otherwise."""
    OWNER_START = 10
    """The driver's start time, in clock ticks after boot: with OWNER_PID it names one process, pid reuse or not."""
    OWNER_PID_NS = 11
    """Inode of the driver's PID namespace: OWNER_PID means nothing in another namespace. 0 in older versions' files."""
    OWNER_BOOT = 12
    """The first 60 bits of the boot id the driver ran under."""


_STATS_BASE = 16


class Stat(IntEnum):
    """Statistics words (int64) in the header after the fixed words; each has one writer (its prefix's role)."""

    TEACHER_ROWS = _STATS_BASE
    THETA_ROWS = _STATS_BASE + 1
    TEACHER_WAIT_NS = _STATS_BASE + 2
    THETA_WAIT_NS = _STATS_BASE + 3
    MIX_NS = _STATS_BASE + 4
    TEACHER_STEPS = _STATS_BASE + 5
    THETA_STEPS = _STATS_BASE + 6
    TEACHER_TIMEOUTS = _STATS_BASE + 7
    THETA_TIMEOUTS = _STATS_BASE + 8
    TEACHER_ABANDONED = _STATS_BASE + 9
    THETA_ABANDONED = _STATS_BASE + 10
    SPLIT_STEPS = _STATS_BASE + 11
    """Teacher steps whose theta rows arrived in more than one round (batches out of phase; 0 by construction)."""
    LEADER_ADMITTED = _STATS_BASE + 12
    LEADER_ENDED = _STATS_BASE + 13
    """Requests the teacher scheduler ended itself: aborts, stop strings, errors."""
    FOLLOWER_PLAN_WAIT_NS = _STATS_BASE + 14
    """Time the theta scheduler waited for the teacher scheduler's plan."""
    FOLLOWER_DIVERGED = _STATS_BASE + 15
    """Plan entries the theta scheduler could not run (each fails its request alone)."""
    PREEMPTIONS_REFUSED = _STATS_BASE + 16


_HEADER_WORDS = 64


class Bell(IntEnum):
    """Doorbells (int32 futex words), one per direction of waiting."""

    THETA_ROWS = 0
    """Theta processor -> teacher processor: rows published."""
    TEACHER_TOKENS = 1
    """Teacher processor -> theta processor: tokens decided."""
    PLAN = 2
    """Teacher scheduler -> theta scheduler: a plan or an ending published. The driver rings it after a submit."""
    TO_LEADER = 3
    """Theta scheduler (arrivals) and driver (submits, aborts) -> teacher scheduler."""


_BELLS = 16  # 64 bytes: their own cache line


class Writer(IntEnum):
    """Who rings a bell; part of the value stored, so two writers never store the same value."""

    DRIVER = 1
    TEACHER_SCHEDULER = 2
    THETA_SCHEDULER = 3
    TEACHER_PROCESSOR = 4
    THETA_PROCESSOR = 5


class Slot(IntEnum):
    """Per-slot control words (int64)."""

    KEY = 0
    """Driver: the occupying request's key (> 0); -key once the driver has read the slot; 0 never used."""
    TEACHER_PROMPT_LEN = 1
    THETA_PROMPT_LEN = 2
    """Driver: prompt lengths, so the teacher scheduler can budget both engines' prefills."""
    ABORT = 3
    """Driver, or either scheduler turning a vLLM abort into a lockstep one: key of the request to end."""
    TEACHER_ARRIVED = 4
    THETA_ARRIVED = 5
    """Each side's scheduler: key of the request once it sits in that scheduler's queue."""
    PHASE = 6
    """Teacher scheduler: :class:`Phase` of the occupying request."""
    ADMIT_PLAN = 7
    """Teacher scheduler: number of the first plan that holds the request."""
    FINISH_PLAN = 8
    """Teacher scheduler: number of the first plan that no longer holds it."""
    FINISH = 9
    """Teacher scheduler: :class:`Finish` reason."""
    STOP_INDEX = 10
    """Teacher scheduler: index of the stop string that ended it, else -1."""
    THETA_STEP = 11
    """Theta processor: step of the row in ``theta_logprobs`` (written after the row)."""
    TEACHER_STEP = 12
    """Teacher processor: step of the token in ``TOKEN`` (written after the token and records)."""
    TOKEN = 13
    NUM_RECORDS = 14
    ERROR = 15
    """The request's error: ``code | step << 8`` in one store (:meth:`SyncSession.fail_slot`); 0 if none."""
    TEACHER_RELEASED = 16
    THETA_RELEASED = 17
    """Key of the request that side no longer touches (its processor saw it leave, or it never ran)."""


_CONTROL_WORDS = 24


class Phase(IntEnum):
    """Life of a request in its slot, as the teacher scheduler decides it."""

    EMPTY = 0
    SUBMITTED = 1
    """Opened by the driver; not yet in any plan."""
    RUNNING = 2
    """In every plan from ADMIT_PLAN on."""
    FINISHED = 3
    """In no plan from FINISH_PLAN on (ADMIT_PLAN = -1: never admitted)."""


class Finish(IntEnum):
    """Why a request ended (the teacher scheduler's word on it)."""

    NONE = 0
    STOP = 1
    """An EOS or a stop token id."""
    STOP_STRING = 2
    LENGTH = 3
    ABORT = 4
    ERROR = 5


class ErrorCode(IntEnum):
    """Why a request failed; stored in :attr:`Slot.ERROR`."""

    NONE = 0
    SYNC_TIMEOUT = 1
    """A processor waited longer than sync_timeout for its partner."""
    BAD_LOGITS = 2
    """NaN or +inf logits, or nothing left to sample."""
    PREEMPTED = 3
    """An engine tried to preempt the request (its KV cache ran out); refused."""
    DIVERGED = 4
    """The two engines' batches differed for this request; it could not be kept in lockstep."""
    SHUTDOWN = 5
    """The session shut down while the request ran."""
    DECISION_ERROR = 6
    """An exception in an engine's work for this request alone (deciding its token, publishing theta's row,
    checking its stop strings); the engine logs it and serves the other requests."""
    NON_FINITE = 7
    """A decided token's α, log π_t, log π_θ or log q was not finite; nothing of it was recorded."""

    @property
    def label(self) -> str:
        return self.name.lower()


WRITERS: dict[Slot, tuple[str, ...]] = {
    Slot.KEY: ("driver",),
    Slot.TEACHER_PROMPT_LEN: ("driver",),
    Slot.THETA_PROMPT_LEN: ("driver",),
    Slot.ABORT: ("driver", "teacher scheduler", "theta scheduler"),  # all store the same key
    Slot.TEACHER_ARRIVED: ("teacher scheduler",),
    Slot.THETA_ARRIVED: ("theta scheduler",),
    Slot.PHASE: ("teacher scheduler",),
    Slot.ADMIT_PLAN: ("teacher scheduler",),
    Slot.FINISH_PLAN: ("teacher scheduler",),
    Slot.FINISH: ("teacher scheduler",),
    Slot.STOP_INDEX: ("teacher scheduler",),
    Slot.THETA_STEP: ("theta processor",),
    Slot.TEACHER_STEP: ("teacher processor",),
    Slot.TOKEN: ("teacher processor",),
    Slot.NUM_RECORDS: ("teacher processor",),
    Slot.ERROR: ("teacher processor", "theta processor", "teacher scheduler", "theta scheduler"),  # one store each
    Slot.TEACHER_RELEASED: ("teacher processor", "teacher scheduler"),  # never both for one key
    Slot.THETA_RELEASED: ("theta processor", "theta scheduler"),
}
"""Which role writes each slot word. Words with several writers are written by single stores of values that agree."""


def check_host() -> None:
    """Refuse hosts whose memory model could reorder the protocol's plain stores."""
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in ("x86_64", "amd64"):
        raise SyncError(
            f"dual-sampling runs on Linux x86-64 only (this host: {platform.system()} {machine}): its shared-memory "
            "protocol relies on stores becoming visible in program order, which other architectures do not guarantee "
            "without fences"
        )


@dataclass(frozen=True)
class SessionLayout:
    """Sizes of one session's shared file; byte offsets are derived from them."""

    vocab: int
    """Tokens per logits row (the shared tokenizer's vocabulary, padding rows excluded)."""
    slots: int
    """Requests that can be submitted to the engines at once."""
    max_steps: int
    """Generated tokens recorded per request (at least max_model_len)."""
    plan_width: int
    """Requests per engine step at most (max_num_seqs)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "slots", "max_steps", "plan_width"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each region, each aligned to a cache line, and the total size."""
        sizes = [
            ("header", 8 * _HEADER_WORDS),
            ("bells", 4 * _BELLS),
            ("plans", 8 * PLAN_RING * (2 + self.plan_width)),
            ("control", 8 * _CONTROL_WORDS * self.slots),
            ("theta_logprobs", 4 * self.vocab * self.slots),
            ("tokens", 4 * self.max_steps * self.slots),
            ("records", 4 * len(RECORD_FIELDS) * self.max_steps * self.slots),
            ("top_ids", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
            ("top_logq", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
        ]
        out, pos = {}, 0
        for name, size in sizes:
            out[name] = pos
            pos += (size + 63) // 64 * 64
        out["total"] = pos
        return out


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word in a shared mapping (Linux x86-64)."""

    _SYS_FUTEX = 202

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        supported = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
        self.libc = ctypes.CDLL(None, use_errno=True) if supported else None

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        if self.libc is None:
            time.sleep(min(timeout_s, 0.001))
            return
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        # Shared (non-private) futex: the word lives in a mapping shared across processes.
        self.libc.syscall(
            self._SYS_FUTEX, ctypes.c_void_p(address), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0
        )

    def wake(self, address: int) -> None:
        if self.libc is not None:
            self.libc.syscall(self._SYS_FUTEX, ctypes.c_void_p(address), 1, ctypes.c_int(2**31 - 1), None, None, 0)


_FUTEX = _Futex()


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` of this PID namespace, in clock ticks after boot (/proc/<pid>/stat field 22).

    None if no such process runs (zombies count as gone). A pid and its start time name one
    process: a later process given the same pid has a later start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name before ")" may hold spaces
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in this PID namespace (zombies count as gone)."""
    return process_start_time(pid) is not None


def _own_tag() -> tuple[int, int, int]:
    """(boot, PID namespace inode, start time) of this process, as the header of a session it creates records them.

    Read on each call, never cached: a forked child has its own start time, and may have its own namespace.
    """
    boot = int(Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:15], 16)
    start = process_start_time(os.getpid())
    assert start is not None  # this process runs
    return boot, os.stat("/proc/self/ns/pid").st_ino, start


def cleanup_stale_sessions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove what dead drivers of this user left in ``shm_dir``: session files, and the files their engines listed.

    Session files are ``dual-sampling-<pid>-<token>``; listings are in this user's private
    :func:`listing_dir` (or, from older versions, next to the sessions). A session is stale when
    its header's driver (pid and start time) no longer runs; one of another boot is stale too.
    One of another PID namespace is left alone with a warning: its pid means nothing here. A
    session file without that tag (older versions) or a listing without its session file is
    judged by its pid alone. Only this user's regular files are touched (symlinks never); another
    user's leftovers are theirs, logged and left. A session file goes only once its listing has.
    Never raises for what it finds. Returns the names removed.
    """
    own = _own_tag()
    gone: dict[str, bool] = {}

    def stale(session: str, pid: int) -> bool:
        if session not in gone:
            gone[session] = _session_gone(shm_dir / session, pid, own)
        return gone[session]

    removed: list[str] = []
    listed: set[str] = set()  # sessions whose listing stays (a file it names is still mapped)
    private = _private_dir_if_safe(shm_dir)
    listings = sorted(private.iterdir()) if private else []
    for path in [*listings, *sorted(shm_dir.glob(SESSION_PREFIX + "*.segments*"))]:
        m = _LISTING_NAME.fullmatch(path.name)
        if not m or not _own_file(path) or not stale(m["session"], int(m["pid"])):
            continue
        if m["tmp"]:  # its writer died between writing and renaming it
            path.unlink(missing_ok=True)
            removed.append(path.name)
            continue
        gone_now = _remove_listed(path, shm_dir)
        removed += gone_now
        if path.name not in gone_now:
            listed.add(m["session"])
    for path in sorted(shm_dir.glob(SESSION_PREFIX + "*")):
        m = _SESSION_NAME.fullmatch(path.name)
        if m and path.name not in listed and stale(path.name, int(m["pid"])):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path.name)
    if private:
        _remove_if_empty(private)
    return removed


def _session_gone(path: Path, pid: int, own: tuple[int, int, int]) -> bool:
    """Whether the driver of session ``path`` (``pid`` in its name) is gone, as far as this process can tell.

    ``own`` is this process's :func:`_own_tag`. A file that is not this user's regular file is
    never judged gone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return not pid_alive(pid)
    except OSError as exc:  # a symlink (ELOOP), or another user's file (EACCES)
        logger.warning("session file %s is left alone: %s", path, exc.strerror)
        return False
    try:
        st = os.fstat(fd)
        if not _own_stat(path, st):
            return False
        raw = os.pread(fd, 8 * _HEADER_WORDS, 0)
    finally:
        os.close(fd)
    header = np.frombuffer(raw, np.int64) if len(raw) == 8 * _HEADER_WORDS else None
    if header is None or int(header[Header.MAGIC]) != _MAGIC or int(header[Header.OWNER_PID_NS]) == 0:
        return not pid_alive(pid)  # no tag: an older version's session
    boot, namespace, _ = own
    if int(header[Header.OWNER_BOOT]) != boot:
        return True
    if int(header[Header.OWNER_PID_NS]) != namespace:
        logger.warning(
            "session %s is left alone: its driver ran in another PID namespace (inode %d, this one's is %d), "
            "whose processes cannot be seen from here",
            path,
            int(header[Header.OWNER_PID_NS]),
            namespace,
        )
        return False
    return process_start_time(int(header[Header.OWNER_PID])) != int(header[Header.OWNER_START])


def _own_stat(path: Path, st: os.stat_result) -> bool:
    """Whether ``st`` (of ``path``, not followed) is a regular file of this user; logs why not."""
    if not S_ISREG(st.st_mode):
        logger.warning("%s is left alone: not a regular file (mode %o)", path, st.st_mode)
        return False
    if st.st_uid != os.getuid():
        logger.warning("%s is left to its owner, uid %d (this is uid %d)", path, st.st_uid, os.getuid())
        return False
    return True


def _own_file(path: Path) -> bool:
    """Whether ``path`` exists and is a regular file of this user, without following a symlink."""
    try:
        return _own_stat(path, os.lstat(path))
    except FileNotFoundError:
        return False


def session_owners(shm_dir: Path = SHM_DIR) -> set[int]:
    """Pids named by the session files in ``shm_dir`` (their drivers, alive or not)."""
    return {int(m["pid"]) for path in shm_dir.glob(SESSION_PREFIX + "*") if (m := _SESSION_NAME.fullmatch(path.name))}


def _remove_listed(listing: Path, shm_dir: Path) -> list[str]:
    """Remove the files a stale listing names (segments of this user no live process maps), then the listing.

    Names of any other form (a path, '..', an unknown kind) and files that are not this
    user's regular files are dropped from the listing, with a warning, and never touched.
    """
    try:
        names = json.loads(listing.read_text())
    except (FileNotFoundError, ValueError):
        names = []
    candidates = []
    for name in names if isinstance(names, list) else []:
        if not (isinstance(name, str) and _LISTED_NAME.fullmatch(name)):
            logger.warning("%s lists %r, not a shared-memory segment name; it is not removed", listing, name)
        elif _own_file(shm_dir / name):
            candidates.append(name)
    mapped = mapped_shm_files() if candidates else set()
    removed, kept = [], []
    for name in candidates:
        if name in mapped:
            kept.append(name)  # an engine of the dead driver may still be exiting: a later cleanup removes it
            continue
        # /dev/shm is sticky: no other user can swap the file checked above for one of theirs before this.
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove %s: %s", shm_dir / name, exc.strerror)
            continue
        removed.append(name)
    if kept:
        try:
            moved = segments_listing(listing.name.removesuffix(".segments"), shm_dir)  # an older version's: moved
            write_listing(moved, kept)
        except SyncError as exc:
            logger.warning("%s is kept as it is: %s", listing, exc)
            return removed
        if moved != listing:
            listing.unlink(missing_ok=True)
        return removed
    listing.unlink(missing_ok=True)
    return [*removed, listing.name]


def mapped_shm_files(pids: list[int] | None = None) -> set[str]:
    """Names in /dev/shm of the files mapped by the given processes (every readable one when None).

    Matched by inode, not by the path a mapping shows: a POSIX semaphore is mapped under the
    temporary name it was created with and reached through a link (``sem.mp-*``) made after.
    Only processes of this PID namespace can be seen.
    """
    if pids is None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(SHM_DIR) + "/"):
                inodes.add(int(parts[4]))
    names = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.inode() in inodes:
                    names.add(entry.name)
    return names


def listing_dir(shm_dir: Path = SHM_DIR) -> Path:
    """This user's directory for listings, ``<shm_dir>/dual-sampling.<uid>``, created with mode 0700 if missing.

    Raises SyncError naming the path if it is a symlink, not a directory, another user's, or
    open to group or others: another user could then plant listings that a cleanup acts on.
    """
    return _make_private(_listing_dir_path(shm_dir))


def _make_private(path: Path) -> Path:
    """Make directory ``path`` (mode 0700) unless it exists, and check that it is this user's alone."""
    for _ in range(3):  # a cleanup removes it when it finds it empty; make it again
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        _check_private(path, st)
        return path
    raise SyncError(f"{path} keeps disappearing while it is made")


def _listing_dir_path(shm_dir: Path) -> Path:
    return shm_dir / f"{_LISTING_DIR_PREFIX}{os.getuid()}"


def _check_private(path: Path, st: os.stat_result) -> None:
    uid = os.getuid()
    if S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return
    kind = "a symlink" if S_ISLNK(st.st_mode) else "a directory" if S_ISDIR(st.st_mode) else "a file"
    raise SyncError(
        f"{path} must be a directory of uid {uid} with mode 0700 (the listings of shared-memory segments to clean up "
        f"after a crash), but it is {kind} of uid {st.st_uid} with mode {S_IMODE(st.st_mode):04o}; remove it"
    )


def _private_dir_if_safe(shm_dir: Path) -> Path | None:
    """This user's listing directory if it exists and is safe to read; an unsafe one is logged and skipped."""
    path = _listing_dir_path(shm_dir)
    try:
        _check_private(path, os.lstat(path))
    except FileNotFoundError:
        return None
    except SyncError as exc:
        logger.warning("the listings there are not cleaned up: %s", exc)
        return None
    return path


def _remove_if_empty(directory: Path) -> None:
    """Remove the listing directory once it holds nothing; a writer makes it again (:func:`write_listing`)."""
    with contextlib.suppress(OSError):  # not empty, already gone, or not this user's to remove
        os.rmdir(directory)


def write_listing(listing: Path, names: Iterable[str]) -> None:
    """Replace ``listing`` with these /dev/shm names in one rename (a reader never sees half a list).

    ``listing`` is in this user's :func:`listing_dir`, made again if a cleanup removed it.
    """
    text = json.dumps(sorted(names))
    tmp = listing.with_name(listing.name + ".tmp")
    for attempt in range(3):
        _make_private(listing.parent)
        try:
            tmp.write_text(text)
            os.replace(tmp, listing)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise  # the directory was removed again between making it and writing (a cleanup found it empty)


def segments_listing(session_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """Where a session lists the /dev/shm files its engines created, for cleanup after a crash.

    In this user's :func:`listing_dir`, which is made (or checked) here.
    """
    if not _SESSION_NAME.fullmatch(session_name):
        raise ValueError(f"{session_name!r} is not a session name ({SESSION_PREFIX}<pid>-<hex>)")
    return listing_dir(shm_dir) / f"{session_name}.segments"


def _reserve(fd: int, size: int, shm_dir: Path, layout: SessionLayout) -> None:
    """Allocate ``size`` bytes for the session file ``fd`` now.

    A tmpfs file made only large (ftruncate) gets its pages when first touched; on a full
    /dev/shm (Docker's default is 64 MiB) that touch is a SIGBUS in whichever process makes it.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        vfs = os.statvfs(shm_dir)
        free = vfs.f_bavail * vfs.f_frsize
        raise SyncError(
            f"{shm_dir} has {free} bytes ({free / _MiB:.1f} MiB) free, less than the {size} bytes "
            f"({size / _MiB:.1f} MiB) a session of vocab={layout.vocab}, slots={layout.slots}, "
            f"max_steps={layout.max_steps} needs: enlarge it (Docker: --shm-size) or lower max_num_seqs or "
            "max_model_len"
        ) from None


def _name_file(fd: int, directory: Path, name: str) -> None:
    """Give the unnamed (O_TMPFILE) file ``fd`` the name ``name`` in ``directory``; FileExistsError if it is taken."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # linkat(AT_SYMLINK_FOLLOW) through /proc: the one way to link an unnamed file (dst_dir_fd selects linkat).
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


class SyncSession:
    """A mapped session file. The driver creates it (:meth:`create`); the plugins :meth:`attach` by name."""

    def __init__(self, name: str, layout: SessionLayout, mm: mmap.mmap, owner: bool, shm_dir: Path = SHM_DIR) -> None:
        self.name, self.layout, self.owner, self.shm_dir = name, layout, owner, shm_dir
        self._mm = mm
        off = layout.offsets
        buf = memoryview(mm)
        s, v, t = layout.slots, layout.vocab, layout.max_steps
        self.header = np.frombuffer(buf, np.int64, _HEADER_WORDS, off["header"])
        self.bells = np.frombuffer(buf, np.int32, _BELLS, off["bells"])
        self.plans = np.frombuffer(buf, np.int64, PLAN_RING * (2 + layout.plan_width), off["plans"]).reshape(
            PLAN_RING, -1
        )
        self.control = np.frombuffer(buf, np.int64, _CONTROL_WORDS * s, off["control"]).reshape(s, _CONTROL_WORDS)
        self.theta_logprobs = np.frombuffer(buf, np.float32, v * s, off["theta_logprobs"]).reshape(s, v)
        self.tokens = np.frombuffer(buf, np.int32, t * s, off["tokens"]).reshape(s, t)
        self.records = np.frombuffer(buf, np.float32, len(RECORD_FIELDS) * t * s, off["records"]).reshape(s, t, -1)
        k = TOP_LOGPROBS_MAX
        self.top_ids = np.frombuffer(buf, np.int32, k * t * s, off["top_ids"]).reshape(s, t, k)
        self.top_logq = np.frombuffer(buf, np.float32, k * t * s, off["top_logq"]).reshape(s, t, k)
        self._bell_anchor = ctypes.c_char.from_buffer(mm, off["bells"])
        self._bell_base = ctypes.addressof(self._bell_anchor)
        self._ring_lock = threading.Lock()
        self._ring_count = itertools.count(1)
        self._close_lock = threading.Lock()
        """Held by close() and by what other threads may call during it (statistics, request_abort)."""
        self._closed = False
        self._final_statistics: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, layout: SessionLayout, shm_dir: Path = SHM_DIR) -> SyncSession:
        """Create a new session file with a unique name, after removing stale ones.

        Its whole size is allocated now. SyncError, naming the sizes, if ``shm_dir`` cannot hold it,
        and naming the path if this user's :func:`listing_dir` is unsafe.
        """
        check_host()
        cleanup_stale_sessions(shm_dir)
        listing_dir(shm_dir)  # refuse an unsafe one now, not once the engines have started
        name = f"{SESSION_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        size = layout.offsets["total"]
        # Unnamed until its header holds the owner's tag, so a cleanup never finds an untagged session of this version.
        fd = os.open(shm_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            _reserve(fd, size, shm_dir, layout)
            mm = mmap.mmap(fd, size)
            session = cls(name, layout, mm, owner=True, shm_dir=shm_dir)
            try:
                h = session.header
                h[Header.VOCAB], h[Header.SLOTS], h[Header.MAX_STEPS] = layout.vocab, layout.slots, layout.max_steps
                h[Header.PLAN_WIDTH], h[Header.OWNER_PID] = layout.plan_width, os.getpid()
                h[Header.OWNER_BOOT], h[Header.OWNER_PID_NS], h[Header.OWNER_START] = _own_tag()
                session.plans[:, 0] = -1
                h[Header.MAGIC] = _MAGIC  # last: an attacher never sees a half-initialised header
                _name_file(fd, shm_dir, name)
            except BaseException:
                session.close()
                raise
        finally:
            os.close(fd)
        return session

    @classmethod
    def attach(cls, name: str, shm_dir: Path = SHM_DIR) -> SyncSession:
        """Map an existing session by name (inside an engine process)."""
        path = shm_dir / name
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.frombuffer(mm, np.int64, _HEADER_WORDS, 0)
        if int(header[Header.MAGIC]) != _MAGIC:
            del header
            mm.close()
            raise SyncError(f"shared-memory file {path} is not a session of this dual-sampling version")
        layout = SessionLayout(
            *(int(header[w]) for w in (Header.VOCAB, Header.SLOTS, Header.MAX_STEPS, Header.PLAN_WIDTH))
        )
        del header
        return cls(name, layout, mm, owner=False, shm_dir=shm_dir)

    @property
    def path(self) -> Path:
        return self.shm_dir / self.name

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap; the owner also removes the file. Safe to call twice, and from any thread.

        During and after it, :meth:`statistics` and :meth:`request_abort` stay safe to call from
        other threads; no other method may be called once close has begun.
        """
        with self._close_lock:
            if self._closed:
                return
            if self.owner:
                self.shutdown()
            self._final_statistics = self._read_statistics()
            self._closed = True
            del self.header, self.bells, self.plans, self.control, self.theta_logprobs, self.tokens, self.records
            del self.top_ids, self.top_logq
            del self._bell_anchor
            with contextlib.suppress(BufferError):  # a view is still alive somewhere; the mapping goes with the process
                self._mm.close()
            if self.owner:
                self.path.unlink(missing_ok=True)
                _remove_if_empty(_listing_dir_path(self.shm_dir))

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ doorbells

    def ring(self, bell: Bell, writer: Writer) -> None:
        """Announce new data to the waiters on ``bell``, by storing a value no earlier store used."""
        with self._ring_lock:
            self.bells[bell] = (int(writer) << 24) | (next(self._ring_count) & 0xFFFFFF)
        _FUTEX.wake(self._bell_base + 4 * int(bell))

    def bell_value(self, bell: Bell) -> int:
        return int(self.bells[bell])

    def wait_bell(self, bell: Bell, seen: int, timeout_s: float) -> None:
        """Block until ``bell`` differs from ``seen`` or ``timeout_s`` passes (it may return early)."""
        if int(self.bells[bell]) == seen and timeout_s > 0:
            _FUTEX.wait(self._bell_base + 4 * int(bell), seen, timeout_s)

    # ------------------------------------------------------------------ session state

    def shutdown(self) -> None:
        """Tell every waiter to stop waiting; rows in flight are abandoned."""
        self.header[Header.SHUTDOWN] = 1
        for bell in Bell:
            self.ring(bell, Writer.DRIVER)

    @property
    def is_shut_down(self) -> bool:
        return bool(self.header[Header.SHUTDOWN])

    def owner_alive(self) -> bool:
        return pid_alive(int(self.header[Header.OWNER_PID]))

    def statistics(self) -> dict[str, int]:
        """Every :class:`Stat` counter, by lower-case name; once closed, their values at :meth:`close`. Thread-safe."""
        with self._close_lock:
            return dict(self._final_statistics) if self._closed else self._read_statistics()

    def _read_statistics(self) -> dict[str, int]:
        return {stat.name.lower(): int(self.header[stat]) for stat in Stat}

    def add_stat(self, stat: Stat, amount: int) -> None:
        """Add to a counter this process alone writes."""
        self.header[stat] += int(amount)

    # ------------------------------------------------------------------ plans

    def publish_plan(self, number: int, keys: list[int]) -> None:
        """Teacher scheduler: plan ``number`` runs exactly ``keys`` (announced by the number, written last)."""
        if len(keys) > self.layout.plan_width:
            raise SyncError(
                f"plan {number} holds {len(keys)} requests, more than max_num_seqs={self.layout.plan_width}"
            )
        row = self.plans[number % PLAN_RING]
        row[0] = -1
        row[1] = len(keys)
        row[2 : 2 + len(keys)] = keys
        row[0] = number
        self.header[Header.PLANS_PUBLISHED] = number + 1
        self.ring(Bell.PLAN, Writer.TEACHER_SCHEDULER)

    def read_plan(self, number: int) -> list[int] | None:
        """Theta scheduler: the keys of plan ``number``, or None if it is not published yet."""
        row = self.plans[number % PLAN_RING]
        if int(row[0]) != number:
            return None
        keys = row[2 : 2 + int(row[1])].tolist()
        return keys if int(row[0]) == number else None  # overwritten while read: not yet ours to take

    # ------------------------------------------------------------------ slots

    def slot_key(self, slot: int) -> int:
        return int(self.control[slot, Slot.KEY])

    def slot_free(self, slot: int) -> bool:
        """Driver: the slot can take a new request (both sides released its last one, and it was read)."""
        c = self.control[slot]
        key = int(c[Slot.KEY])
        return key == 0 or (key < 0 and int(c[Slot.TEACHER_RELEASED]) == -key and int(c[Slot.THETA_RELEASED]) == -key)

    def open_slot(self, slot: int, key: int, teacher_prompt_len: int, theta_prompt_len: int) -> None:
        """Driver: prepare a free slot for request ``key`` (> 0) before either engine sees it."""
        if key <= 0:
            raise ValueError(f"request keys must be positive, got {key}")
        if not self.slot_free(slot):
            raise SyncError(f"slot {slot} is still in use")
        c = self.control[slot]
        c[:] = 0
        c[Slot.TEACHER_PROMPT_LEN], c[Slot.THETA_PROMPT_LEN] = teacher_prompt_len, theta_prompt_len
        c[Slot.THETA_STEP] = c[Slot.TEACHER_STEP] = c[Slot.TOKEN] = -1
        c[Slot.ADMIT_PLAN] = c[Slot.FINISH_PLAN] = c[Slot.STOP_INDEX] = -1
        c[Slot.PHASE] = Phase.SUBMITTED
        c[Slot.KEY] = key  # last: the slot is announced once everything above is set

    def close_slot(self, slot: int) -> None:
        """Driver: it has read the slot; the slot is free once both sides have released the request too."""
        key = self.slot_key(slot)
        if key > 0:
            self.control[slot, Slot.KEY] = -key

    def request_abort(self, slot: int, key: int, writer: Writer) -> None:
        """Ask the teacher scheduler to end request ``key`` on both engines at the next step boundary.

        Thread-safe against :meth:`close`; nothing to do once closed (the shutdown ended every request).
        """
        with self._close_lock:
            if not self._closed and self.slot_key(slot) == key:
                self.control[slot, Slot.ABORT] = key
                self.ring(Bell.TO_LEADER, writer)

    def abort_requested(self, slot: int, key: int) -> bool:
        return int(self.control[slot, Slot.ABORT]) == key

    def fail_slot(self, slot: int, key: int, code: ErrorCode, step: int, writer: Writer) -> None:
        """Record an error of request ``key`` unless one is recorded (one store of code and step); wake both processors.

        Of the four writers, an engine's processor and scheduler never run at once (its EngineCore
        schedules only once the step it executes is done; async scheduling is refused), so only the
        two engines can race: both may read 0 and both store, and the later store stays (numpy has
        no compare-and-swap). Every reader still agrees: the processors and schedulers only ask
        whether an error is recorded, and the driver reads the code once, after both engines have
        ended the request, when nothing stores to the word any more.
        """
        c = self.control[slot]
        if int(c[Slot.KEY]) == key and int(c[Slot.ERROR]) == 0:
            c[Slot.ERROR] = int(code) | (max(step, 0) << 8)
        self.ring(Bell.THETA_ROWS, writer)
        self.ring(Bell.TEACHER_TOKENS, writer)

    def error(self, slot: int) -> tuple[ErrorCode, int]:
        """(code, step) of the slot's first error; (NONE, -1) if none."""
        word = int(self.control[slot, Slot.ERROR])
        return (ErrorCode(word & 0xFF), word >> 8) if word else (ErrorCode.NONE, -1)

    def release(self, slot: int, key: int, word: Slot) -> None:
        """Mark that one side no longer touches request ``key`` (``word``: TEACHER_RELEASED or THETA_RELEASED).

        Only while the slot still holds that request (open or read by the driver): a late
        release can never overwrite the release of the slot's next occupant.
        """
        if abs(self.slot_key(slot)) == key:
            self.control[slot, word] = key
