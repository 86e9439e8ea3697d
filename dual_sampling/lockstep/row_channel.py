"""The row channel: how theta's log-probability rows reach the teacher's decision. One seam, three transports.

Theta publishes a step's rows into their slots and only then writes the slots' step words (the
announcement); the teacher reads the announced rows of its ready slots. Every transport keeps
that order: :meth:`RowChannel.publish` returns once the rows are where the teacher reads them.

- ``host``: the session's ``[slots, V]`` float32 rows in /dev/shm, written and read by the CPU.
  The transport of CPU engines, and the one whose logic the tests check.
- ``pinned``: the same shared-memory rows, page-locked on each GPU side (``cudaHostRegister``),
  so copies to and from them run as DMA on the engine's stream. Works between any two GPUs on
  any PCIe topology. Theta waits for its copies before it announces; the teacher's copy is
  ordered before its decision on its stream and never waits on the host.
- ``device``: a ``[slots, V]`` buffer on the teacher's GPU, shared with theta's process through
  CUDA IPC (the handle lies in a file beside the session). Theta writes its rows there device to
  device and waits for the write before it announces; the teacher gathers them on its GPU.
  Needs both engines on the same GPU (or peer-to-peer GPUs).

``auto`` picks device, then pinned, then host (:func:`resolve_transport`), once at start-up. A
transport that cannot work is refused there, by name.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

__all__ = [
    "ROW_TRANSPORTS",
    "DeviceRows",
    "HostRows",
    "PinnedRows",
    "RowChannel",
    "RowGatherer",
    "open_row_channel",
    "resolve_transport",
]

ROW_TRANSPORTS = ("auto", "host", "pinned", "device")
"""Values of the ``row_transport`` engine option."""


def resolve_transport(requested: str, device_type: str, same_device: bool = True) -> str:
    """The transport for engines on ``device_type`` ("cpu", "cuda", ...): ``requested``, or for "auto" the fastest
    that works (device, then pinned, then host). ``same_device``: both engines on one GPU or on peer-to-peer GPUs.

    Raises ValueError naming ``row_transport`` for an unknown value or one these engines cannot use.
    """
    if requested not in ROW_TRANSPORTS:
        raise ValueError(f"row_transport must be one of {ROW_TRANSPORTS}, got {requested!r}")
    cuda = device_type == "cuda"
    if requested == "auto":
        return ("device" if same_device else "pinned") if cuda else "host"
    if requested != "host" and not cuda:
        raise ValueError(f"row_transport={requested!r} needs CUDA engines; these engines run on {device_type!r}")
    if requested == "device" and not same_device:
        raise ValueError(
            "row_transport='device' needs both engines on one GPU or on peer-to-peer GPUs; use 'pinned' across others"
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
    """Theta's side publishes rows into slots; the teacher's side reads the rows of slots."""

    name: ClassVar[str] = ""

    def publish(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """Store ``rows`` ``[n, V]`` (float32, on theta's device) in ``slots``; complete when this returns."""
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


class DeviceRows(RowChannel):
    """A rows buffer on the teacher's GPU, shared with theta's process through CUDA IPC."""

    name = "device"

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    @classmethod
    def create(cls, handle_path: Path, slots: int, vocab: int, device: torch.device) -> DeviceRows:
        """The teacher's side: allocate the buffer and write its IPC handle to ``handle_path`` (atomically)."""
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.full((slots, vocab), float("nan"), dtype=torch.float32, device=device)
        rebuild, args = reduce_tensor(buffer)
        tmp = handle_path.with_name(handle_path.name + ".tmp")  # a crash before the rename leaves <session>.rows.tmp
        tmp.write_bytes(pickle.dumps((rebuild, args)))
        tmp.rename(handle_path)
        return cls(buffer)

    @classmethod
    def attach(cls, handle_path: Path, timeout: float) -> DeviceRows:
        """Theta's side: open the teacher's buffer, waiting up to ``timeout`` seconds for its handle."""
        deadline = time.monotonic() + timeout
        while not handle_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"row_transport='device': the teacher's rows buffer ({handle_path}) never appeared")
            time.sleep(0.01)
        rebuild, args = pickle.loads(handle_path.read_bytes())
        return cls(rebuild(*args))

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
    transport: str, role: str, rows: np.ndarray, device: torch.device, handle_path: Path, timeout: float
) -> RowChannel:
    """The channel of a resolved ``transport`` for the ``role`` engine on ``device``: ``rows`` are the session's
    shared-memory rows, ``handle_path`` where the device buffer's handle goes (teacher) or comes from (theta)."""
    if transport == "host":
        return HostRows(rows)
    if device.type != "cuda":
        raise ValueError(f"row_transport={transport!r} needs a CUDA engine; the {role} engine runs on {device}")
    if transport == "pinned":
        return PinnedRows(rows, device)
    if transport == "device":
        if role == "teacher":
            return DeviceRows.create(handle_path, rows.shape[0], rows.shape[1], device)
        return DeviceRows.attach(handle_path, timeout)
    raise ValueError(f"row_transport must be resolved to one of {ROW_TRANSPORTS[1:]}, got {transport!r}")
