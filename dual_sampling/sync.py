"""Shared memory between the driver and the two engines' logits processors.

One session is one file in /dev/shm, mapped by the driver and by the logits processor
inside each engine's worker process. It holds, per request *slot*:

- control words: the request key occupying the slot, the step of theta's last published
  log-probability row, the step and id of the teacher's last decided token, finish and release
  flags for each side, and an error code;
- theta's log-probability row for the current step (float32 ``[V]``, the log-softmax of its
  logits): theta publishes, the teacher reads, so each step moves one row across, once;
- the per-token records the teacher writes (token id, α, log π_t, log π_θ, log q).

Protocol invariants (``docs/architecture.md`` has the full argument):

- A row is read only when its step word equals the reader's step, so a fast engine can
  never read the previous step's data.
- Theta's row for step s+1 exists only after the teacher decided step s, so one row
  buffer per slot suffices.
- A slot is reused only when both processors released it (saw the request leave their
  batch) and the driver has read its records.

The admission gate keeps the two engines' batches in phase. A request that joins the
teacher's batch one engine step earlier than theta's would make every teacher step wait
for theta's next step, serialising the two models for its whole life. So the driver admits
new requests while the gate is held: each processor, at the end of its step, parks until
the driver has handed the new requests to both engines and opened the gate; both engines
then take them in at the same step. The gate affects speed only, never correctness: a
processor parks for at most ``park_limit_s``.

Waits block on a futex (Linux), with a short timeout so that rare driver events are seen
even if a wake is missed; elsewhere they back off with sleeps. They never spin.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SyncSession", "SessionLayout", "SyncError", "cleanup_stale_sessions", "SHM_DIR", "SESSION_PREFIX",
           "ERR_NONE", "ERR_TIMEOUT", "ERR_PARTNER_GONE", "ERR_BAD_LOGITS", "ERR_STALE", "ERROR_NAMES"]

SHM_DIR = Path("/dev/shm")
SESSION_PREFIX = "dual-sampling-"
_MAGIC = 0x44554131  # "DUA1"

# Slot control words (int64).
KEY, THETA_STEP, TEACHER_STEP, TOKEN, THETA_FINISHED, TEACHER_FINISHED, THETA_RELEASED, TEACHER_RELEASED, \
    ERROR, ERROR_STEP, NUM_RECORDS = range(11)
_CONTROL_WORDS = 16

# Header words (int64). The statistics words are each written by one process only.
_H_MAGIC, _H_VOCAB, _H_SLOTS, _H_STEPS, _H_OWNER, _H_SHUTDOWN = range(6)
STAT_TEACHER_ROWS, STAT_THETA_ROWS, STAT_TEACHER_WAIT_NS, STAT_THETA_WAIT_NS, STAT_MIX_NS, \
    STAT_TEACHER_ABANDONED, STAT_THETA_ABANDONED, STAT_TEACHER_TIMEOUTS, STAT_TEACHER_CALLS, STAT_THETA_CALLS, \
    STAT_THETA_TIMEOUTS = range(6, 17)
# The admission gate (driver writes HELD and OPENED; each processor writes its own PARKED word).
_H_GATE_HELD, _H_GATE_OPENED, _H_TEACHER_PARKED, _H_THETA_PARKED, STAT_PARKED_NS, STAT_SPLIT_STEPS = range(17, 23)
STAT_NAMES = {
    STAT_TEACHER_ROWS: "teacher_rows", STAT_THETA_ROWS: "theta_rows",
    STAT_TEACHER_WAIT_NS: "teacher_wait_ns", STAT_THETA_WAIT_NS: "theta_wait_ns", STAT_MIX_NS: "mix_ns",
    STAT_TEACHER_ABANDONED: "teacher_abandoned_rows", STAT_THETA_ABANDONED: "theta_abandoned_rows",
    STAT_TEACHER_TIMEOUTS: "teacher_timeouts", STAT_THETA_TIMEOUTS: "theta_timeouts",
    STAT_TEACHER_CALLS: "teacher_steps", STAT_THETA_CALLS: "theta_steps", STAT_PARKED_NS: "teacher_parked_ns",
    # Teacher steps whose rows arrived in more than one of theta's steps: the engines' batches were out of phase.
    STAT_SPLIT_STEPS: "split_steps",
}
_HEADER_WORDS = 32
# Doorbells (int32 futex words): one writer each on the hot path.
BELL_TO_TEACHER, BELL_TO_THETA, BELL_GATE = 0, 1, 2
_BELLS = 16  # 64 bytes, its own cache line

ERR_NONE, ERR_TIMEOUT, ERR_PARTNER_GONE, ERR_BAD_LOGITS, ERR_STALE = range(5)
ERROR_NAMES = {
    ERR_TIMEOUT: "sync_timeout",
    ERR_PARTNER_GONE: "partner_gone",
    ERR_BAD_LOGITS: "bad_logits",
    ERR_STALE: "stale_slot",
}

# Record columns (float32), in this order: α, log π_t, log π_θ, log q at the sampled token.


class SyncError(RuntimeError):
    """A request could not be synchronised between the two engines."""


@dataclass(frozen=True)
class SessionLayout:
    """Sizes of one session's shared file; byte offsets are derived from them."""

    vocab: int
    """Tokens per logits row (the shared tokenizer's vocabulary, padding rows excluded)."""
    slots: int
    """Requests that can be in flight at once."""
    max_steps: int
    """Generated tokens recorded per request (at least max_model_len)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "slots", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def offsets(self) -> dict[str, int]:
        sizes = [
            ("header", 8 * _HEADER_WORDS),
            ("bells", 4 * _BELLS),
            ("control", 8 * _CONTROL_WORDS * self.slots),
            ("theta_logprobs", 4 * self.vocab * self.slots),
            ("tokens", 4 * self.max_steps * self.slots),
            ("records", 16 * self.max_steps * self.slots),
        ]
        out, pos = {}, 0
        for name, size in sizes:
            out[name] = pos
            pos += (size + 63) // 64 * 64
        out["total"] = pos
        return out


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word in a shared mapping (Linux x86_64 and aarch64)."""

    _SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        self.number = self._SYSCALL.get(platform.machine().lower()) if platform.system() == "Linux" else None
        self.libc = ctypes.CDLL(None, use_errno=True) if self.number is not None else None

    @property
    def available(self) -> bool:
        return self.libc is not None

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        # Shared (non-private) futex: the word lives in a mapping shared across processes.
        self.libc.syscall(self.number, ctypes.c_void_p(address), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0)

    def wake(self, address: int) -> None:
        self.libc.syscall(self.number, ctypes.c_void_p(address), 1, ctypes.c_int(2**31 - 1), None, None, 0)


_FUTEX = _Futex()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_sessions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove session files whose owning driver process is dead; return their names.

    Names carry the owner's pid (``dual-sampling-<pid>-<token>``); live sessions are kept.
    """
    removed = []
    pattern = re.compile(re.escape(SESSION_PREFIX) + r"(\d+)-[0-9a-f]+$")
    for path in shm_dir.glob(SESSION_PREFIX + "*"):
        m = pattern.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed


class SyncSession:
    """A mapped session file. The driver creates it (``create``); processors ``attach`` by name."""

    def __init__(self, name: str, layout: SessionLayout, mm: mmap.mmap, owner: bool) -> None:
        self.name, self.layout, self.owner = name, layout, owner
        self._mm = mm
        off = layout.offsets
        buf = memoryview(mm)
        self.header = np.frombuffer(buf, np.int64, _HEADER_WORDS, off["header"])
        self.bells = np.frombuffer(buf, np.int32, _BELLS, off["bells"])
        self.control = np.frombuffer(buf, np.int64, _CONTROL_WORDS * layout.slots, off["control"]).reshape(layout.slots, _CONTROL_WORDS)
        self.theta_logprobs = np.frombuffer(buf, np.float32, layout.vocab * layout.slots, off["theta_logprobs"]).reshape(layout.slots, layout.vocab)
        self.tokens = np.frombuffer(buf, np.int32, layout.max_steps * layout.slots, off["tokens"]).reshape(layout.slots, layout.max_steps)
        self.records = np.frombuffer(buf, np.float32, 4 * layout.max_steps * layout.slots, off["records"]).reshape(layout.slots, layout.max_steps, 4)
        self._bell_anchor = ctypes.c_char.from_buffer(mm, off["bells"])
        self._bell_base = ctypes.addressof(self._bell_anchor)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, layout: SessionLayout, shm_dir: Path = SHM_DIR) -> "SyncSession":
        """Create a new session file with a unique name, after removing stale ones."""
        cleanup_stale_sessions(shm_dir)
        name = f"{SESSION_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = shm_dir / name
        size = layout.offsets["total"]
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        session = cls(name, layout, mm, owner=True)
        session.header[[_H_VOCAB, _H_SLOTS, _H_STEPS, _H_OWNER]] = [layout.vocab, layout.slots, layout.max_steps, os.getpid()]
        session.control[:, THETA_RELEASED] = 1
        session.control[:, TEACHER_RELEASED] = 1
        session.header[_H_MAGIC] = _MAGIC
        return session

    @classmethod
    def attach(cls, name: str, shm_dir: Path = SHM_DIR) -> "SyncSession":
        """Map an existing session by name (inside an engine's worker process)."""
        path = shm_dir / name
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.frombuffer(mm, np.int64, _HEADER_WORDS, 0)
        if int(header[_H_MAGIC]) != _MAGIC:
            mm.close()
            raise SyncError(f"shared-memory file {path} is not a dual-sampling session")
        layout = SessionLayout(int(header[_H_VOCAB]), int(header[_H_SLOTS]), int(header[_H_STEPS]))
        del header
        return cls(name, layout, mm, owner=False)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    def close(self) -> None:
        """Unmap; the owner also removes the file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            self.shutdown()
        del self.header, self.bells, self.control, self.theta_logprobs, self.tokens, self.records, self._bell_anchor
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if self.owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SyncSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ doorbells

    def ring(self, bell: int) -> None:
        """Announce new data to the waiters on ``bell``."""
        self.bells[bell] += 1
        if _FUTEX.available:
            _FUTEX.wake(self._bell_base + 4 * bell)

    def bell_value(self, bell: int) -> int:
        return int(self.bells[bell])

    def wait_bell(self, bell: int, seen: int, timeout_s: float) -> None:
        """Block until ``bell`` differs from ``seen`` or ``timeout_s`` passes (may return early)."""
        if int(self.bells[bell]) != seen:
            return
        if _FUTEX.available:
            _FUTEX.wait(self._bell_base + 4 * bell, seen, max(timeout_s, 0.0))
        else:
            time.sleep(min(max(timeout_s, 0.0), 0.0005))

    # ------------------------------------------------------------------ session state

    def shutdown(self) -> None:
        """Tell every waiter to stop waiting (engines abandon their rows)."""
        self.header[_H_SHUTDOWN] = 1
        self.ring(BELL_TO_TEACHER)
        self.ring(BELL_TO_THETA)
        self.ring(BELL_GATE)

    # ------------------------------------------------------------------ admission gate

    def hold_gate(self) -> int:
        """Driver: ask both processors to park at the end of their current step; returns the hold's number."""
        generation = int(self.header[_H_GATE_HELD]) + 1
        self.header[_H_GATE_HELD] = generation
        return generation

    def parked(self, generation: int) -> tuple[bool, bool]:
        """Driver: whether (teacher, theta) are parked for hold ``generation``."""
        return (int(self.header[_H_TEACHER_PARKED]) >= generation, int(self.header[_H_THETA_PARKED]) >= generation)

    def open_gate(self, generation: int) -> None:
        """Driver: release the processors parked for hold ``generation``."""
        self.header[_H_GATE_OPENED] = generation
        self.ring(BELL_GATE)

    def park_if_held(self, role: str, park_limit_s: float) -> float:
        """Processor: if a hold is pending, park until the gate opens (or ``park_limit_s``); returns seconds parked."""
        generation = int(self.header[_H_GATE_HELD])
        if generation <= int(self.header[_H_GATE_OPENED]):
            return 0.0
        start = time.monotonic()
        deadline = start + park_limit_s
        self.header[_H_TEACHER_PARKED if role == "teacher" else _H_THETA_PARKED] = generation
        while int(self.header[_H_GATE_OPENED]) < generation and not self.is_shut_down:
            seen = self.bell_value(BELL_GATE)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if int(self.header[_H_GATE_OPENED]) < generation:
                self.wait_bell(BELL_GATE, seen, min(remaining, 0.05))
        return time.monotonic() - start

    def statistics(self) -> dict[str, int]:
        """Counters the processors keep: rows served, wait and mixing time (ns), abandoned rows, timeouts."""
        return {name: int(self.header[word]) for word, name in STAT_NAMES.items()}

    @property
    def is_shut_down(self) -> bool:
        return bool(self.header[_H_SHUTDOWN])

    # ------------------------------------------------------------------ slots (driver side)

    def slot_free(self, slot: int) -> bool:
        c = self.control[slot]
        return bool(c[KEY] == 0 and c[THETA_RELEASED] and c[TEACHER_RELEASED])

    def open_slot(self, slot: int, key: int) -> None:
        """Prepare a released slot for request ``key`` (> 0) before either engine sees it."""
        if key <= 0:
            raise ValueError(f"request keys must be positive, got {key}")
        c = self.control[slot]
        c[THETA_STEP] = c[TEACHER_STEP] = -1
        c[TOKEN] = -1
        c[THETA_FINISHED] = c[TEACHER_FINISHED] = 0
        c[THETA_RELEASED] = c[TEACHER_RELEASED] = 0
        c[ERROR] = ERR_NONE
        c[ERROR_STEP] = -1
        c[NUM_RECORDS] = 0
        c[KEY] = key

    def close_slot(self, slot: int) -> None:
        """The driver has read the slot; it becomes free once both engines released it."""
        self.control[slot, KEY] = 0

    def mark_finished(self, slot: int, side_finished_word: int) -> None:
        """The driver saw one engine finish the request: release a partner still waiting on it."""
        self.control[slot, side_finished_word] = 1
        self.ring(BELL_TO_TEACHER)
        self.ring(BELL_TO_THETA)

    def fail_slot(self, slot: int, code: int, step: int) -> None:
        """Record the first error of a slot and wake both sides."""
        c = self.control[slot]
        if c[ERROR] == ERR_NONE:
            c[ERROR_STEP] = step
            c[ERROR] = code
        self.ring(BELL_TO_TEACHER)
        self.ring(BELL_TO_THETA)
