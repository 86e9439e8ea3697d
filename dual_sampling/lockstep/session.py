"""One lockstep session's shared memory, mapped: slots, doorbells, the plan ring and records.

The layout and who writes each word are in :mod:`dual_sampling.lockstep.layout`. Doorbells
are futex words: a wait blocks with a cap, so a shutdown is seen within the cap even
without a wake.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import itertools
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dual_sampling.lockstep.janitor import (
    cleanup_stale_sessions,
    listing_dir,
    own_listing_dirs,
    owner_tag,
    pid_alive,
    remove_if_empty,
    rows_handle,
)
from dual_sampling.lockstep.layout import (
    BELL_WORDS,
    HEADER_WORDS,
    MAGIC,
    MODEL_WORDS,
    PLAN_RING,
    SESSION_PREFIX,
    SHM_DIR,
    TOP_LOGPROBS_MAX,
    Bell,
    ErrorCode,
    Header,
    MiB,
    ModelSlot,
    ModelWord,
    Phase,
    SessionLayout,
    Slot,
    Stat,
    SyncError,
    Writer,
    check_host,
    slot_word,
)
from dual_sampling.roster import PAIR

logger = logging.getLogger(__name__)


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word in a shared mapping (Linux x86-64: :func:`check_host`)."""

    _SYS_FUTEX = 202  # x86-64's syscall number; a session is only created after check_host()

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        # Shared (non-private) futex: the word lives in a mapping shared across processes.
        self.libc.syscall(
            self._SYS_FUTEX, ctypes.c_void_p(address), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0
        )

    def wake(self, address: int) -> None:
        self.libc.syscall(self._SYS_FUTEX, ctypes.c_void_p(address), 1, ctypes.c_int(2**31 - 1), None, None, 0)


_FUTEX = _Futex()


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
            f"{shm_dir} has {free} bytes ({free / MiB:.1f} MiB) free, less than the {size} bytes "
            f"({size / MiB:.1f} MiB) a session of vocab={layout.vocab}, slots={layout.slots}, "
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
        self.header = np.frombuffer(buf, np.int64, HEADER_WORDS, off["header"])
        m, f = layout.models, layout.followers
        self.model_words = np.frombuffer(buf, np.int64, MODEL_WORDS * m, off["model_words"]).reshape(m, MODEL_WORDS)
        """``[models, MODEL_WORDS]``: each model's :class:`ModelWord` counters, by roster position."""
        self.bells = np.frombuffer(buf, np.int32, BELL_WORDS, off["bells"])
        self.plans = np.frombuffer(buf, np.int64, PLAN_RING * (2 + layout.plan_width), off["plans"]).reshape(
            PLAN_RING, -1
        )
        w = layout.control_words
        self.control = np.frombuffer(buf, np.int64, w * s, off["control"]).reshape(s, w)
        self.follower_logprobs = np.frombuffer(buf, np.float32, f * v * s, off["follower_logprobs"]).reshape(f, s, v)
        """``[followers, slots, V]``: each follower's log-probability row of the current step (follower ``i`` is
        roster position ``i + 1``)."""
        self.follower_log_normalisers = np.frombuffer(buf, np.float64, f * s, off["follower_log_normalisers"]).reshape(
            f, s
        )
        self.tokens = np.frombuffer(buf, np.int32, t * s, off["tokens"]).reshape(s, t)
        self.records = np.frombuffer(buf, np.float32, layout.record_width * t * s, off["records"]).reshape(s, t, -1)
        k = TOP_LOGPROBS_MAX
        self.top_ids = np.frombuffer(buf, np.int32, k * t * s, off["top_ids"]).reshape(s, t, k)
        self.top_logq = np.frombuffer(buf, np.float32, k * t * s, off["top_logq"]).reshape(s, t, k)
        self.top_logp = np.frombuffer(buf, np.float32, m * k * t * s, off["top_logp"]).reshape(s, t, m, k)
        """``[slots, steps, models, k]``: log π of each model (roster order) at ``top_ids``."""
        d = layout.dense_k
        self.dense_ids = np.frombuffer(buf, np.int32, m * d * t * s, off["dense_ids"]).reshape(s, t, m, d)
        """``[slots, steps, models, k]``: each model's own k most likely tokens (roster order)."""
        self.dense_logp = np.frombuffer(buf, np.float32, m * m * d * t * s, off["dense_logp"]).reshape(s, t, m, m, d)
        """``[slots, steps, models, models, k]``: ``[..., i, j, :]`` is log π_j at model i's ``dense_ids``."""
        self._bell_anchor = ctypes.c_char.from_buffer(mm, off["bells"])
        self._bell_base = ctypes.addressof(self._bell_anchor)
        self._ring_lock = threading.Lock()
        self._ring_count = itertools.count(1)
        self._close_lock = threading.Lock()
        """Held by close() and by what other threads may call during it (statistics, request_abort)."""
        self._closed = False
        self._final_statistics: dict[str, int] = {}
        self.names: tuple[str, ...] = (
            PAIR.names if layout.models == 2 else tuple(f"model{p}" for p in range(layout.models))
        )
        """The models' names by roster position, for :meth:`statistics`; whoever knows the roster may set it."""

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, layout: SessionLayout, shm_dir: Path = SHM_DIR) -> SyncSession:
        """Create a new session file with a unique name, after removing stale ones.

        Its whole size is allocated now. SyncError, naming the sizes, if ``shm_dir`` cannot hold it.
        """
        check_host()
        cleanup_stale_sessions(shm_dir)
        listing_dir(shm_dir)  # made (or found) now, not once the engines have started
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
                for f in dataclasses.fields(layout):
                    h[layout.header_word(f.name)] = getattr(layout, f.name)
                h[Header.OWNER_PID] = os.getpid()
                h[Header.OWNER_BOOT], h[Header.OWNER_PID_NS], h[Header.OWNER_START] = owner_tag()
                session.plans[:, 0] = -1
                h[Header.MAGIC] = MAGIC  # last: an attacher never sees a half-initialised header
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
        header = np.frombuffer(mm, np.int64, HEADER_WORDS, 0)
        if int(header[Header.MAGIC]) != MAGIC:
            del header
            mm.close()
            raise SyncError(f"shared-memory file {path} is not a session of this dual-sampling version")
        layout = SessionLayout(
            **{f.name: int(header[SessionLayout.header_word(f.name)]) for f in dataclasses.fields(SessionLayout)}
        )
        del header
        return cls(name, layout, mm, owner=False, shm_dir=shm_dir)

    @property
    def path(self) -> Path:
        return self.shm_dir / self.name

    @property
    def rows_handle_path(self) -> Path:
        """Where the device row channel's buffer handle lies (``lockstep.row_channel``): in this user's private
        :func:`~dual_sampling.lockstep.janitor.listing_dir`, never in /dev/shm itself. Removed with the session."""
        return rows_handle(self.name, self.shm_dir)

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
            del self.header, self.model_words, self.bells, self.plans, self.control
            del self.follower_logprobs, self.follower_log_normalisers, self.tokens, self.records
            del (
                self.top_ids,
                self.top_logq,
                self.top_logp,
                self.dense_ids,
                self.dense_logp,
            )
            del self._bell_anchor
            with contextlib.suppress(BufferError):  # a view is still alive somewhere; the mapping goes with the process
                self._mm.close()
            if self.owner:
                self.path.unlink(missing_ok=True)
                for directory in own_listing_dirs(self.shm_dir):  # its row handle's (rows_handle_path), and empty ones
                    (directory / f"{self.name}.rows").unlink(missing_ok=True)
                    remove_if_empty(directory)

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ doorbells

    def ring(self, bell: Bell, writer: int) -> None:
        """Announce new data to the waiters on ``bell``, by storing a value no earlier store used; ``writer`` is
        :meth:`Writer.at` of the ringing plugin."""
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

    # ------------------------------------------------------------------ the hold of pause(mode="keep")

    def hold(self, on: bool) -> None:
        """Driver: start the hold (``on``; the leader's engine is paused, so its count of plans is final) or end it.
        While held, each follower runs the plans published before the hold, then steps nothing."""
        self.header[Header.HOLD] = int(self.header[Header.PLANS_PUBLISHED]) + 1 if on else 0
        self.ring(Bell.PLAN, Writer.DRIVER)

    @property
    def held(self) -> bool:
        return bool(self.header[Header.HOLD])

    def plans_before_hold(self) -> int | None:
        """The plans the leader published before the hold (the followers run them all); None without a hold."""
        noted = int(self.header[Header.HOLD])
        return noted - 1 if noted else None

    def owner_alive(self) -> bool:
        return pid_alive(int(self.header[Header.OWNER_PID]))

    def statistics(self) -> dict[str, int]:
        """Every :class:`Stat` counter by lower-case name, and every reported :class:`ModelWord` as
        ``<model>_<word>`` (models named by :attr:`names`) or summed over the followers as ``follower_<word>``; once
        closed, their values at :meth:`close`. Thread-safe."""
        with self._close_lock:
            return dict(self._final_statistics) if self._closed else self._read_statistics()

    def _read_statistics(self) -> dict[str, int]:
        out: dict[str, int] = {}
        names = self.names
        for word in ModelWord:
            if word.reported is None:
                continue
            if word.summed:
                out[f"follower_{word.reported}"] = int(self.model_words[1:, word].sum())
            else:
                out.update({f"{name}_{word.reported}": int(self.model_words[p, word]) for p, name in enumerate(names)})
        return {**out, **{stat.name.lower(): int(self.header[stat]) for stat in Stat}}

    def add_stat(self, stat: Stat, amount: int) -> None:
        """Add to a counter this process alone writes."""
        self.header[stat] += int(amount)

    def add_model_stat(self, position: int, word: ModelWord, amount: int) -> None:
        """Add to a counter of model ``position`` that this process alone writes."""
        self.model_words[position, word] += int(amount)

    # ------------------------------------------------------------------ plans

    def publish_plan(self, number: int, keys: list[int]) -> None:
        """Leader scheduler: plan ``number`` runs exactly ``keys`` (announced by the number, written last)."""
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
        self.ring(Bell.PLAN, Writer.SCHEDULER.at(0))

    def read_plan(self, number: int) -> list[int] | None:
        """Follower scheduler: the keys of plan ``number``, or None if it is not published yet."""
        row = self.plans[number % PLAN_RING]
        if int(row[0]) != number:
            return None
        keys = row[2 : 2 + int(row[1])].tolist()
        return keys if int(row[0]) == number else None  # overwritten while read: not yet ours to take

    # ------------------------------------------------------------------ slots

    def slot_key(self, slot: int) -> int:
        return int(self.control[slot, Slot.KEY])

    def slot_free(self, slot: int) -> bool:
        """Driver: the slot can take a new request (every engine released its last one, and it was read)."""
        c = self.control[slot]
        key = int(c[Slot.KEY])
        return key == 0 or (key < 0 and all(int(c[word]) == -key for word in self._released_words))

    def held_slots(self) -> list[int]:
        """The slots that are not free (:meth:`slot_free`): a request holds them, or they wait to be read."""
        return [slot for slot in range(self.layout.slots) if not self.slot_free(slot)]

    def open_slot(
        self, slot: int, key: int, prompt_lens: Sequence[int], participants: Sequence[int] | None = None
    ) -> None:
        """Driver: prepare a free slot for request ``key`` (> 0) before any engine sees it; ``prompt_lens``: each
        model's prompt length, by roster position; ``participants``: the positions whose engines run it (None: all;
        the leader's always). A model left out is marked arrived and released at once, with a prompt of length 0:
        the leader admits and budgets the request without it, and the slot frees without it."""
        if key <= 0:
            raise ValueError(f"request keys must be positive, got {key}")
        if len(prompt_lens) != self.layout.models:
            raise ValueError(f"prompt_lens must hold one length per model ({self.layout.models}), got {prompt_lens!r}")
        taking_part = set(range(self.layout.models) if participants is None else participants)
        if 0 not in taking_part or not taking_part <= set(range(self.layout.models)):
            raise ValueError(f"participants must be roster positions including the leader's (0), got {participants!r}")
        if not self.slot_free(slot):
            raise SyncError(f"slot {slot} is still in use")
        c = self.control[slot]
        c[:] = 0
        for position, length in enumerate(prompt_lens):
            c[slot_word(ModelSlot.ROW_STEP, position)] = -1
            if position in taking_part:
                c[slot_word(ModelSlot.PROMPT_LEN, position)] = length
            else:
                c[slot_word(ModelSlot.ARRIVED, position)] = c[slot_word(ModelSlot.RELEASED, position)] = key
        c[Slot.PARTICIPANTS] = sum(1 << position for position in taking_part)
        c[Slot.DECIDED_STEP] = c[Slot.TOKEN] = -1
        c[Slot.ADMIT_PLAN] = c[Slot.FINISH_PLAN] = c[Slot.STOP_INDEX] = -1
        c[Slot.PHASE] = Phase.SUBMITTED
        c[Slot.KEY] = key  # last: the slot is announced once everything above is set

    def close_slot(self, slot: int) -> None:
        """Driver: it has read the slot; the slot is free once every engine has released the request too."""
        key = self.slot_key(slot)
        if key > 0:
            self.control[slot, Slot.KEY] = -key

    def request_abort(self, slot: int, key: int, writer: int) -> None:
        """Ask the leader scheduler to end request ``key`` on every engine at the next step boundary.

        Thread-safe against :meth:`close`; nothing to do once closed (the shutdown ended every request).
        """
        with self._close_lock:
            if not self._closed and self.slot_key(slot) == key:
                self.control[slot, Slot.ABORT] = key
                self.ring(Bell.TO_LEADER, writer)

    def abort_requested(self, slot: int, key: int) -> bool:
        return int(self.control[slot, Slot.ABORT]) == key

    def fail_slot(self, slot: int, key: int, code: ErrorCode, step: int, writer: int) -> None:
        """Record an error of request ``key`` unless one is recorded (one store of code and step); wake the processors.

        The one way :attr:`Slot.ERROR` is written. Of its four writers (:data:`WRITERS`), an engine's
        processor and scheduler never run at once (its EngineCore schedules only once the step it
        executes is done; async scheduling is refused), so only different engines can race: each may
        read 0 and store, and the last store stays (numpy has no compare-and-swap). Every
        reader still agrees: the processors and schedulers only ask whether an error is recorded,
        and the driver reads the code once, after every engine has ended the request, when nothing
        stores to the word any more.
        """
        c = self.control[slot]
        if int(c[Slot.KEY]) == key and int(c[Slot.ERROR]) == 0:
            c[Slot.ERROR] = int(code) | (max(step, 0) << 8)
        self.ring(Bell.ROWS, writer)
        self.ring(Bell.TOKENS, writer)

    def error(self, slot: int) -> tuple[ErrorCode, int]:
        """(code, step) of the slot's first error; (NONE, -1) if none."""
        word = int(self.control[slot, Slot.ERROR])
        return (ErrorCode(word & 0xFF), word >> 8) if word else (ErrorCode.NONE, -1)

    def takes_part(self, slot: int, key: int, position: int) -> bool:
        """Whether model ``position``'s engine runs request ``key`` of ``slot`` (False once the slot holds another)."""
        c = self.control[slot]
        return abs(int(c[Slot.KEY])) == key and bool(int(c[Slot.PARTICIPANTS]) >> position & 1)

    def release(self, slot: int, key: int, position: int) -> None:
        """Mark that model ``position``'s engine no longer touches request ``key``.

        Only while the slot still holds that request (open or read by the driver): a late
        release can never overwrite the release of the slot's next occupant.
        """
        if abs(self.slot_key(slot)) == key:
            self.control[slot, slot_word(ModelSlot.RELEASED, position)] = key

    @functools.cached_property
    def _released_words(self) -> tuple[int, ...]:
        """Each model's ``RELEASED`` word of a slot's control row (the layout's, fixed for the session)."""
        return tuple(slot_word(ModelSlot.RELEASED, p) for p in range(self.layout.models))
