"""The row channel: how a follower's log-probability rows reach the leader's decision (θ's rows the teacher's, in a
pair). One seam, three transports; the leader opens one channel per follower.

A follower publishes a step's rows into their slots and only then writes the slots' step words (the
announcement); the leader reads the announced rows of its ready slots. Every transport keeps
that order: :meth:`RowChannel.publish` returns once the rows are where the leader reads them.

- ``host``: the follower's ``[slots, V]`` float32 rows in /dev/shm, written and read by the CPU.
  The transport of CPU engines, and the one whose logic the tests check.
- ``pinned``: the same shared-memory rows, page-locked on each GPU side (``cudaHostRegister``),
  so copies to and from them run as DMA on the engine's stream. Works between any two GPUs on
  any PCIe topology. The follower waits for its copies before it announces; the leader's copy is
  ordered before its decision on its stream and never waits on the host.
- ``device``: a ``[slots, V]`` buffer on the leader's GPU, shared with the follower's process through
  CUDA IPC. The follower writes its rows there device to device and waits for the write before it
  announces; the leader gathers them on its GPU. Needs both engines on the same GPU (each
  engine's processes see only their own GPU: driver/placement.py), and one follower (the buffer's
  handle has one file). The handle (:class:`BufferHandle`) goes through a file in this
  user's private folder (mode 0700, the session's ``rows_handle_path``), as JSON: never a pickle,
  and the follower reads it only from a regular file of its own user that no one else may write.

``auto`` picks device, then pinned, then host (:func:`resolve_transport`), once at start-up. A
transport that cannot work is refused there, by name.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from dual_sampling.checks import is_int
from dual_sampling.lockstep.layout import SyncError

__all__ = [
    "ROW_TRANSPORTS",
    "BufferHandle",
    "DeviceRows",
    "HostRows",
    "PinnedRows",
    "RowChannel",
    "RowGatherer",
    "open_row_channel",
    "read_handle",
    "resolve_transport",
    "write_handle",
]

ROW_TRANSPORTS = ("auto", "host", "pinned", "device")
"""Values of the ``row_transport`` engine option."""


def resolve_transport(requested: str, device_type: str, same_device: bool = True, followers: int = 1) -> str:
    """The transport for engines on ``device_type`` ("cpu", "cuda", ...): ``requested``, or for "auto" the fastest
    that works (device, then pinned, then host). ``same_device``: every engine on one GPU; ``followers``: the
    engines whose rows reach the leader (the device transport's one buffer holds one follower's).

    Raises ValueError naming ``row_transport`` for an unknown value or one these engines cannot use.
    """
    if requested not in ROW_TRANSPORTS:
        raise ValueError(f"row_transport must be one of {ROW_TRANSPORTS}, got {requested!r}")
    cuda = device_type == "cuda"
    if requested == "auto":
        return ("device" if same_device and followers == 1 else "pinned") if cuda else "host"
    if requested == "device" and followers > 1:
        raise ValueError(
            f"row_transport='device' shares one follower's rows buffer; these engines have {followers} followers: "
            "use 'pinned'"
        )
    if requested != "host" and not cuda:
        raise ValueError(f"row_transport={requested!r} needs CUDA engines; these engines run on {device_type!r}")
    if requested == "device" and not same_device:
        raise ValueError(
            "row_transport='device' needs both engines on one GPU (each engine sees only its own); use 'pinned' "
            "across two"
        )
    return requested


class RowGatherer:
    """Selected rows of a ``[N, ≥ vocab]`` tensor as one ``[n, vocab]`` float32 tensor on the CPU, without a fresh copy.

    Consecutive rows of a tensor exactly ``vocab`` wide come back as a view. Other rows are
    copied into a buffer kept from step to step, so the result is only valid until the next
    call. A fresh copy of 32 rows of V = 262,144 took about 20 ms on the CPU, most of it page
    faults on the new memory; into the kept buffer it takes about 4 ms. Other devices and
    dtypes get a plain gather.
    """

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._buffer: torch.Tensor | None = None

    def __call__(self, source: torch.Tensor, rows: list[int]) -> torch.Tensor:
        n = len(rows)
        if source.device.type != "cpu" or source.dtype != torch.float32:
            return source[torch.tensor(rows, device=source.device), : self.vocab].float()
        first = rows[0]
        if source.shape[1] == self.vocab and rows == list(range(first, first + n)):
            return source[first : first + n]
        if self._buffer is None or self._buffer.shape[0] < n:
            self._buffer = torch.empty(n, self.vocab, dtype=torch.float32)
        out = self._buffer[:n]
        torch.index_select(source[:, : self.vocab], 0, torch.tensor(rows), out=out)
        return out


class RowChannel:
    """A follower's side publishes rows into slots; the leader's side reads the rows of slots."""

    name: ClassVar[str] = ""

    def publish(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """Store ``rows`` ``[n, V]`` (float32, on the follower's device) in ``slots``; complete when this returns."""
        raise NotImplementedError

    def read(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        """The rows of ``slots`` as ``[n, V]`` float32 on ``device``, valid until the next call."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the channel holds (never the session's own memory)."""


class HostRows(RowChannel):
    """The session's shared-memory rows, copied by the CPU."""

    name = "host"

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = torch.from_numpy(rows)  # a view of the shared memory
        self._gather = RowGatherer(self.rows.shape[1])

    def publish(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        self.rows[torch.tensor(list(slots))] = rows.to("cpu", torch.float32)

    def read(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        return self._gather(self.rows, list(slots)).to(device)


class PinnedRows(HostRows):
    """The shared-memory rows page-locked for this process's GPU: DMA copies, ordered on the engine's stream."""

    name = "pinned"

    def __init__(self, rows: np.ndarray, device: torch.device) -> None:
        super().__init__(rows)
        self.device = device
        error = torch.cuda.cudart().cudaHostRegister(self.rows.data_ptr(), self.rows.numel() * 4, 0)
        if int(error) != 0:
            raise RuntimeError(f"row_transport='pinned': cudaHostRegister of the session's rows failed ({error})")
        self._registered = True
        self._staging: torch.Tensor | None = None

    def publish(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        for k, slot in enumerate(slots):
            self.rows[slot].copy_(rows[k], non_blocking=True)
        # The announcement is a host write: it must follow the copies.
        torch.cuda.current_stream(rows.device).synchronize()

    def read(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        n = len(slots)
        if self._staging is None or self._staging.shape[0] < n or self._staging.device != device:
            self._staging = torch.empty(max(n, 1), self.rows.shape[1], dtype=torch.float32, device=device)
        out = self._staging[:n]
        for k, slot in enumerate(slots):  # ordered before the decision on this stream; no host wait
            out[k].copy_(self.rows[slot], non_blocking=True)
        return out

    def close(self) -> None:
        if self._registered:
            self._registered = False
            torch.cuda.cudart().cudaHostUnregister(self.rows.data_ptr())


_HANDLE_FORMAT = "dual-sampling rows handle 1"
"""The ``format`` word of a handle file: a file of any other format (or version) is refused."""
_HANDLE_MAX_BYTES = 1 << 16
"""A handle file is a few hundred bytes; no more than this is read of one."""


@dataclasses.dataclass(frozen=True)
class BufferHandle:
    """What the follower's process needs to open the leader's rows buffer: its CUDA IPC handles and where the rows lie.

    The arguments :func:`torch.multiprocessing.reductions.reduce_tensor` gives ``rebuild_cuda_tensor`` for a CUDA
    tensor, by their names there, less those fixed here (a float32 :class:`torch.Tensor` in a typed storage, no
    gradient). In a file it is JSON, bytes in base64 (:meth:`to_bytes`), parsed field by field (:meth:`from_bytes`):
    nothing in it is ever run.
    """

    tensor_size: tuple[int, int]
    """(slots, vocab)."""
    tensor_stride: tuple[int, int]
    """In elements."""
    tensor_offset: int
    """Of the buffer in its storage, in elements."""
    storage_device: int
    """The leader's CUDA device index."""
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @classmethod
    def of(cls, buffer: torch.Tensor) -> BufferHandle:
        """The handle of a float32 ``[slots, vocab]`` CUDA tensor, shared through CUDA IPC from now on."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        if buffer.device.type != "cuda" or buffer.dtype != torch.float32 or buffer.dim() != 2:
            raise ValueError(
                f"the rows buffer must be a float32 [slots, vocab] CUDA tensor, got {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device}"
            )
        rebuild, args = reduce_tensor(buffer)
        assert rebuild is rebuild_cuda_tensor  # a CUDA tensor's reduction: its arguments are named by its parameters
        named = dict(zip(inspect.signature(rebuild_cuda_tensor).parameters, args, strict=True))
        named["tensor_size"], named["tensor_stride"] = tuple(named["tensor_size"]), tuple(named["tensor_stride"])
        return cls(**{f.name: named[f.name] for f in dataclasses.fields(cls)})

    def open(self) -> torch.Tensor:
        """The buffer, mapped into this process (the follower's) through CUDA IPC."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        fixed = {"tensor_cls": torch.Tensor, "storage_cls": torch.storage.TypedStorage, "dtype": torch.float32}
        return rebuild_cuda_tensor(**fixed, requires_grad=False, **dataclasses.asdict(self))

    def to_bytes(self) -> bytes:
        """The handle as a handle file holds it: one JSON object, bytes in base64."""
        fields: dict[str, Any] = {"format": _HANDLE_FORMAT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
        return json.dumps(fields).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> BufferHandle:
        """Parse what :meth:`to_bytes` wrote; ValueError naming what is wrong for anything else (a pickle included)."""
        try:
            fields = json.loads(data.decode("utf-8"))
        except ValueError:  # not UTF-8 (a pickle is not), or not JSON
            raise ValueError("the handle is not JSON") from None
        if not isinstance(fields, dict) or fields.get("format") != _HANDLE_FORMAT:
            raise ValueError(f"the handle's format is not {_HANDLE_FORMAT!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != names | {"format"}:
            raise ValueError(f"the handle's fields {sorted(set(fields) ^ (names | {'format'}))} are missing or unknown")
        return cls(**{f.name: _parse_field(f.name, str(f.type), fields[f.name]) for f in dataclasses.fields(cls)})


def _parse_field(name: str, kind: str, value: Any) -> Any:
    """A handle field's ``value`` from JSON as its ``kind`` (the annotation); ValueError naming the field."""
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and is_int(value) and value >= 0:
        return value
    if kind == "tuple[int, int]" and isinstance(value, list) and len(value) == 2:
        if all(is_int(v) and v > 0 for v in value):
            return tuple(value)
    elif kind == "bytes" and isinstance(value, str) and (decoded := _base64(value)):
        return decoded
    wanted = {"bool": "a boolean", "int": "an integer >= 0", "tuple[int, int]": "two positive integers"}
    raise ValueError(f"the handle's {name} must be {wanted.get(kind, 'non-empty base64')}, got {value!r}")


def _base64(text: str) -> bytes:
    """The bytes ``text`` encodes in strict base64; b"" if it is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return b""


def write_handle(path: Path, handle: BufferHandle) -> None:
    """The leader's side: write ``handle`` to ``path`` (mode 0600) in one rename, so a reader never sees part of it.

    ``path`` lies in this user's private folder (the session's ``rows_handle_path``).
    """
    tmp = path.with_name(path.name + ".tmp")  # a crash before the rename leaves <session>.rows.tmp
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(handle.to_bytes())
    os.replace(tmp, path)


def read_handle(path: Path) -> BufferHandle | None:
    """The follower's side: the handle at ``path``, or None while there is none yet.

    Read only from a regular file owned by this process's user that neither group nor others may write, opened without
    following a link and checked on the opened file (``fstat``), so nothing can be swapped in between. SyncError,
    naming the path and the reason, for any other file, and for one that is not a handle
    (:meth:`BufferHandle.from_bytes`).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        raise SyncError(f"row_transport='device': the rows handle {path} is refused: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        problem = _untrusted(os.fstat(fd))
        if problem is None:
            try:
                return BufferHandle.from_bytes(f.read(_HANDLE_MAX_BYTES))  # a larger file is cut short: not JSON
            except ValueError as exc:
                problem = f"malformed: {exc}"
    raise SyncError(f"row_transport='device': the rows handle {path} is refused: {problem}")


def _untrusted(st: os.stat_result) -> str | None:
    """Why a handle file of status ``st`` is not to be trusted; None if it is a regular file of this user, writable
    by no one else."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (mode {st.st_mode:o})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class DeviceRows(RowChannel):
    """A rows buffer on the leader's GPU, shared with the follower's process through CUDA IPC."""

    name = "device"

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    @classmethod
    def create(cls, handle_path: Path, slots: int, vocab: int, device: torch.device) -> DeviceRows:
        """The leader's side: allocate the buffer and write its handle to ``handle_path`` (:func:`write_handle`)."""
        buffer = torch.full((slots, vocab), float("nan"), dtype=torch.float32, device=device)
        write_handle(handle_path, BufferHandle.of(buffer))
        return cls(buffer)

    @classmethod
    def attach(cls, handle_path: Path, timeout: float) -> DeviceRows:
        """The follower's side: open the leader's buffer, waiting up to ``timeout`` seconds for its handle.

        SyncError at once for a handle file that is not to be trusted (:func:`read_handle`).
        """
        deadline = time.monotonic() + timeout
        while (handle := read_handle(handle_path)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"row_transport='device': the leader's rows buffer ({handle_path}) never appeared")
            time.sleep(0.01)
        return cls(handle.open())

    def publish(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        index = torch.tensor(list(slots), device=self.buffer.device)
        self.buffer.index_copy_(0, index, rows.to(self.buffer.device, torch.float32))
        # The announcement is a host write: it must follow the write it announces.
        torch.cuda.current_stream(self.buffer.device).synchronize()

    def read(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        return self.buffer.index_select(0, torch.tensor(list(slots), device=self.buffer.device)).to(device)

    def close(self) -> None:
        self.buffer = None


def open_row_channel(
    transport: str,
    role: str,
    rows: np.ndarray,
    device: torch.device,
    handle_path: Path,
    timeout: float,
    leads: bool = False,
) -> RowChannel:
    """The channel of a resolved ``transport`` for the ``role`` engine on ``device`` (the reading side if ``leads``,
    else the publishing one): ``rows`` are one follower's shared-memory rows, ``handle_path`` where the device
    buffer's handle goes (leader) or comes from (follower)."""
    if transport == "host":
        return HostRows(rows)
    if device.type != "cuda":
        raise ValueError(f"row_transport={transport!r} needs a CUDA engine; the {role} engine runs on {device}")
    if transport == "pinned":
        return PinnedRows(rows, device)
    if transport == "device":
        if leads:
            return DeviceRows.create(handle_path, rows.shape[0], rows.shape[1], device)
        return DeviceRows.attach(handle_path, timeout)
    raise ValueError(f"row_transport must be resolved to one of {ROW_TRANSPORTS[1:]}, got {transport!r}")
