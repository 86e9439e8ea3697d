"""vLLM's weight-transfer protocol on one machine without a GPU: new weights handed over in a shared-memory file.

vLLM updates a running engine's weights through a *weight-transfer engine* in each worker
(``vllm/distributed/weight_transfer``): ``init_transfer_engine`` once, then per update ``start_weight_update``,
any number of ``update_weights`` chunks, and ``finish_weight_update``, driven by ``AsyncLLM``'s methods of those
names or by its RL routes. Its built-in engines move tensors over NCCL or CUDA IPC, neither of which a CPU has. This
module adds one, registered as :data:`ENGINE_NAME`, whose chunk is a file in this user's private folder of
/dev/shm holding the tensors back to back: the sender writes the file, the worker maps it and hands the tensors to
the model's ``load_weights`` (no serialisation; the worker reads the sender's bytes where they lie).

Layout of a chunk (:class:`SharedMemoryUpdateInfo`): ``names``, ``dtype_names`` (torch's names, ``"bfloat16"``),
``shapes`` and ``offsets`` (bytes from the start of the file, each a multiple of :data:`ALIGN`) per tensor, and the
file's ``path``. A file is read only if it is a regular file of this user in one of this user's weights folders
(:func:`weights_folder`: a ``weights-*`` scratch folder of /dev/shm, or a private ``dual-sampling-weights-*`` folder
of the temporary directory when /dev/shm has no room), reached without a symlink, and long enough for every tensor it
lists: a client of the server cannot make the server or an engine read any other kind of file (the values of what
it reads are checked before any engine sees them).

Loading runs vLLM's layerwise reload, as its IPC engine does (``initialize_layerwise_reload`` at start,
``finalize_layerwise_reload`` at finish), then refreshes tied output projections
(:func:`processors.weights_reload.refresh_tied_layers`, which vLLM's reload leaves stale on the CPU). Values are not
checked here: the driver and the server check every chunk (names, shapes, dtypes, finite values) before any
engine sees it, since a layerwise reload cannot be undone once started.

The trainer side (:class:`SharedMemoryTrainerEngine`, registered under the same name in vLLM's
``WeightTransferTrainerFactory``) writes a ``WeightSource`` into such files and drives any client with vLLM's four
weight-sync methods (TRL's async GRPO ``VLLMClient`` has them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import shutil
import stat
import tempfile
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from dual_sampling.lockstep import SHM_DIR
from dual_sampling.lockstep.janitor import own_listing_dirs, scratch_dir
from processors.weights_reload import refresh_tied_layers

__all__ = [
    "ALIGN",
    "DTYPES",
    "ENGINE_NAME",
    "SharedMemoryInitInfo",
    "SharedMemoryTrainerEngine",
    "SharedMemoryTrainerInitInfo",
    "SharedMemoryUpdateInfo",
    "SharedMemoryWeightTransferEngine",
    "chunk_info",
    "copy_chunk",
    "read_chunk",
    "register",
    "weights_folder",
    "write_chunk",
]

ENGINE_NAME = "dual_sampling_shm"
"""The name the engine is registered under in vLLM's factories (``weight_transfer_config={"backend": ...}``)."""
ALIGN = 64
"""Bytes each tensor's offset in a chunk file is a multiple of (a cache line; any dtype's alignment)."""
DTYPES = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")}
"""The dtypes a chunk may carry, by torch's name: the plain floating ones vLLM casts to the engine's dtype."""
_FOLDER_KIND = "weights"
_TEMP_PREFIX = "dual-sampling-weights-"
"""Name prefix of a weights folder in the temporary directory (when /dev/shm has no room)."""
_MAX_BYTES = 1 << 60
"""Bound on a chunk's offsets and sizes: an honest chunk is far below it, and arithmetic past it would overflow the
system calls' 64-bit offsets (a 500, not a refusal)."""


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to agree on: every chunk describes itself. (An empty ``init_info`` is accepted.)"""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors in the file at ``path``, one entry per tensor in each list."""

    path: str
    """Absolute path of the chunk file, in one of this user's ``weights-*`` folders of /dev/shm."""
    names: list[str]
    """The tensors' names, as the checkpoint names them (``model.layers.0.mlp.up_proj.weight``)."""
    dtype_names: list[str]
    """Each tensor's dtype, torch's name without ``torch.`` (a key of :data:`DTYPES`)."""
    shapes: list[list[int]]
    """Each tensor's shape."""
    offsets: list[int]
    """Each tensor's first byte in the file; a multiple of :data:`ALIGN`."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"update_info.path must be a non-empty string, got {self.path!r}")
        for field in ("names", "dtype_names", "shapes", "offsets"):
            if not isinstance(getattr(self, field), list):
                raise ValueError(f"update_info.{field} must be a list, got {type(getattr(self, field)).__name__}")
            if len(getattr(self, field)) != len(self.names):
                raise ValueError(
                    f"update_info.{field} has {len(getattr(self, field))} entries for {len(self.names)} names"
                )
        if not self.names:
            raise ValueError("update_info.names is empty: a chunk holds at least one tensor")
        for index, (name, dtype, shape, offset) in enumerate(
            zip(self.names, self.dtype_names, self.shapes, self.offsets, strict=True)
        ):
            if not isinstance(name, str) or not name:
                raise ValueError(f"update_info.names holds {name!r}, not a tensor name")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise ValueError(f"update_info.dtype_names: {name!r} has dtype {dtype!r}, not one of {list(DTYPES)}")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"update_info.shapes: {name!r} has shape {shape!r}, not a list of sizes")
            if type(offset) is not int or offset < 0 or offset % ALIGN:
                raise ValueError(f"update_info.offsets: {name!r} starts at {offset!r}, not a multiple of {ALIGN}")
            if offset + self.nbytes(index) > _MAX_BYTES:
                raise ValueError(f"update_info: {name!r} ends past byte 2**60: no chunk file is that long")
        if len(set(self.names)) != len(self.names):
            raise ValueError("update_info.names lists a tensor twice")

    def nbytes(self, index: int) -> int:
        """Bytes of tensor ``index`` in the file."""
        numel = 1
        for d in self.shapes[index]:
            numel *= d
        return numel * DTYPES[self.dtype_names[index]].itemsize


def weights_folder(size: int = 0, what: str = "weights") -> Path:
    """A new private folder (mode 0700) for ``size`` bytes of ``what``: in this user's /dev/shm listing when it has
    room for twice that (no disk write, and a cleanup removes it should its maker die first), else in the temporary
    directory; ValueError naming ``what`` when neither has room."""
    tmp = tempfile.gettempdir()
    no_room = f"{what}: no room to stage their {size} bytes"
    try:
        if shutil.disk_usage(SHM_DIR).free > 2 * size:
            return scratch_dir(_FOLDER_KIND)
        if shutil.disk_usage(tmp).free > size:
            return Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ValueError(f"{no_room}: {exc.strerror}") from exc
    raise ValueError(f"{no_room}: neither {SHM_DIR} nor {tmp} has that much free")


def write_chunk(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, name: str = "chunk") -> dict[str, Any]:
    """Write ``tensors`` (any device; copied as they are, dtype kept) into a new file ``folder/name``; returns the
    chunk's ``update_info`` (a plain dict, as vLLM's routes and ``update_weights`` carry it). ValueError when /dev/shm
    has no room for it."""
    tensors = [(n, t.detach()) for n, t in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    for (tensor_name, _), dtype in zip(tensors, dtypes, strict=True):
        if dtype not in DTYPES:
            raise ValueError(f"{tensor_name!r} has dtype {dtype}, not one of {list(DTYPES)}")
    info, size = _packed([n for n, _ in tensors], dtypes, [t.shape for _, t in tensors])
    with _new_file(folder / name, size) as fd:
        for (_, t), offset in zip(tensors, info.offsets, strict=True):
            if t.numel():
                data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                _write_all(fd, memoryview(data), offset)
    info.path = str(folder / name)
    return asdict(info)


def copy_chunk(
    update_info: Any, folder: Path, name: str = "chunk", keep: Collection[str] | None = None
) -> dict[str, Any]:
    """A private copy of a chunk another process wrote, in a new file ``folder/name``; returns the copy's
    ``update_info``. ``keep``: the names to copy (default: all the chunk lists).

    The source must hold every byte of the tensors it lists before anything is reserved for the copy. It is copied by
    the kernel (``copy_file_range``), never mapped: a file its writer shrinks meanwhile gives a short copy (refused),
    not a SIGBUS. Only the bytes of the tensors kept are copied, packed. ValueError naming the field as
    :func:`read_chunk` does, and when a tensor's bytes are not all in the file.
    """
    source = chunk_info(update_info)
    kept = [i for i, tensor in enumerate(source.names) if keep is None or tensor in keep]
    info, size = _packed(
        [source.names[i] for i in kept], [source.dtype_names[i] for i in kept], [source.shapes[i] for i in kept]
    )
    with _opened_chunk(source) as (src, length):
        _check_length(source, length)
        with _new_file(folder / name, size) as dst:
            for at, i in enumerate(kept):
                want, done = source.nbytes(i), 0
                while done < want:
                    step = os.copy_file_range(src, dst, want - done, source.offsets[i] + done, info.offsets[at] + done)
                    if step == 0:
                        raise ValueError(
                            f"update_info: {source.names[i]!r} needs {want} bytes from byte {source.offsets[i]}; the "
                            "file ends first"
                        )
                    done += step
    info.path = str(folder / name)
    return asdict(info)


def _check_length(info: SharedMemoryUpdateInfo, length: int) -> None:
    """ValueError naming the first tensor of ``info`` that ends past a file of ``length`` bytes."""
    for i, name in enumerate(info.names):
        if info.offsets[i] + info.nbytes(i) > length:
            end = info.offsets[i] + info.nbytes(i)
            raise ValueError(f"update_info: {name!r} ends at byte {end}, past the file's {length}")


def read_chunk(update_info: Mapping[str, Any] | SharedMemoryUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a chunk this process's side wrote (:func:`write_chunk`, :func:`copy_chunk`), as views of a
    private mapping of its file, in the order it lists them.

    ValueError naming the field for an ``update_info`` that does not describe a chunk, a file that is not a regular
    file of this user's in one of this user's ``weights-*`` folders (reached without a symlink), or one too short for
    the tensors it lists.
    """
    info = chunk_info(update_info)
    with _opened_chunk(info) as (fd, size):
        _check_length(info, size)
        mapped = mmap.mmap(fd, max(size, 1), access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)
    out = []
    for i, name in enumerate(info.names):
        part = flat[info.offsets[i] : info.offsets[i] + info.nbytes(i)]
        out.append((name, part.view(DTYPES[info.dtype_names[i]]).view(info.shapes[i])))
    return out


def _packed(names: list[str], dtype_names: list[str], shapes: list[Any]) -> tuple[SharedMemoryUpdateInfo, int]:
    """The chunk info of tensors laid out back to back at :data:`ALIGN`-byte offsets (``path`` not yet set), and
    the file's size in bytes."""
    sizes = [[int(d) for d in s] for s in shapes]
    unplaced = SharedMemoryUpdateInfo("-", list(names), list(dtype_names), sizes, [0] * len(sizes))
    offsets, end = [], 0
    for index in range(len(sizes)):
        offsets.append(end)
        end += -(-unplaced.nbytes(index) // ALIGN) * ALIGN
    return dataclasses.replace(unplaced, offsets=offsets), end  # checked again where each tensor lies


@contextlib.contextmanager
def _new_file(path: Path, size: int) -> Iterator[int]:
    """A descriptor of a new file of ``size`` bytes at ``path`` (mode 0600), its blocks reserved; the file is removed
    if the body raises. ValueError when there is no room."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(size, 1))
        except OSError as exc:
            raise ValueError(f"no room in {path.parent} for {size} bytes of weights: {exc.strerror}") from exc
        yield fd
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


@contextlib.contextmanager
def _opened_chunk(info: SharedMemoryUpdateInfo) -> Iterator[tuple[int, int]]:
    """The chunk file's descriptor and size, once it is found to be a regular file of this user's in one of this
    user's weights folders, opened without following a symlink; ValueError naming ``update_info.path`` otherwise."""
    path = Path(info.path)
    if not _in_weights_folder(path):
        raise ValueError(f"update_info.path {info.path!r} is not a file in one of this user's weights folders")
    try:  # O_NONBLOCK: a FIFO planted under the name is refused below instead of hanging the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"update_info.path {info.path!r} cannot be opened: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"update_info.path {info.path!r} is not a regular file of this user")
        yield fd, st.st_size
    finally:
        os.close(fd)


def chunk_info(update_info: Any) -> SharedMemoryUpdateInfo:
    """``update_info`` (a chunk's description, as the routes carry it) checked into a :class:`SharedMemoryUpdateInfo`;
    ValueError naming the field."""
    if isinstance(update_info, SharedMemoryUpdateInfo):
        return update_info
    if not isinstance(update_info, Mapping):
        raise ValueError(f"update_info must be an object, got {type(update_info).__name__}")
    fields = set(SharedMemoryUpdateInfo.__dataclass_fields__)
    unknown = sorted(set(update_info) - fields)
    missing = sorted(fields - set(update_info))
    if unknown or missing:
        raise ValueError(f"update_info: {'unknown field ' + unknown[0] if unknown else 'missing field ' + missing[0]}")
    return SharedMemoryUpdateInfo(**update_info)


def _in_weights_folder(path: Path) -> bool:
    """Whether ``path`` is a file right inside one of this user's weights folders (:func:`weights_folder`), with no
    symlink on the way to the folder."""
    if not path.is_absolute() or ".." in path.parts or len(path.parts) < 3:
        return False
    folder = path.parent
    in_shm = folder.parent in own_listing_dirs() and folder.name.startswith(f"{_FOLDER_KIND}-")
    in_tmp = folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(_TEMP_PREFIX)
    if not (in_shm or in_tmp):
        return False
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """The worker side: loads each chunk's tensors into the model (or the draft model) being updated."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    defers_processing = True
    """On a GPU the loads' copies are on the device's stream until :meth:`finish_weight_update` (or
    :meth:`drain_pending`) synchronises it; on a CPU they are done when ``update_weights`` returns."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> SharedMemoryUpdateInfo:
        return chunk_info(update_dict)

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        """No rendezvous: the chunk files are the channel."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronises the accelerator here, which raises where there is none (defers_processing).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():  # a chunk holds part of the model (as vLLM's IPC engine allows)
            self.model.load_weights(read_chunk(update_info))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_layers(self.model)
        self.drain_pending()

    def drain_pending(self) -> None:
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def shutdown(self) -> None:
        """Nothing held between updates."""


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """The trainer side's settings: how many bytes one chunk file may hold."""

    backend: ClassVar[str] = ENGINE_NAME
    chunk_bytes: int = 1 << 30
    """Tensors are written to files of at most this many bytes (one tensor larger than that gets a file of its own);
    each file is one ``update_weights`` call."""


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
    """The trainer side: each :meth:`send_weights` writes the source's tensors into chunk files and drives the
    client through start, one ``update_weights`` per file, and finish. Files are removed once the client returns
    (the server copies what it keeps). A send that fails after its start still calls finish, as TRL's clients do:
    against :class:`~dual_sampling.driver.weight_sync.WeightSync` a finish that misses tensors is refused and drops the
    update, so the next send can start; a plain vLLM engine would keep what it loaded. On a trainer of several ranks
    every rank iterates the source (its gathers are collectives); only rank 0 writes and calls the client."""

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None, is_sender: bool = True, chunk_bytes: int) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes

    @classmethod
    def trainer_init(
        cls, init_info: SharedMemoryTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> SharedMemoryTrainerEngine:
        if source is None:
            raise ValueError("the shared-memory trainer engine sends a WeightSource; source is None")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, chunk_bytes=init_info.chunk_bytes)
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # the collectives of the gathers
                pass
            return
        self.client.start_weight_update()
        try:
            folder = weights_folder(self.chunk_bytes)
            try:
                for number, chunk in enumerate(_chunks(self.source, self.chunk_bytes)):
                    info = write_chunk(chunk, folder, f"chunk-{number}")
                    try:
                        self.client.update_weights(info)
                    finally:
                        os.unlink(info["path"])
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        except BaseException:
            with contextlib.suppress(Exception):  # the send's own error is the one to raise
                self.client.finish_weight_update()
            raise
        self.client.finish_weight_update()


def _chunks(source: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The source's tensors in runs of at most ``limit`` bytes (a larger tensor alone)."""
    run: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in source:
        nbytes = tensor.numel() * tensor.element_size()
        if run and size + nbytes > limit:
            yield run
            run, size = [], 0
        run.append((name, tensor))
        size += nbytes
    if run:
        yield run


def register() -> None:
    """Register both sides under :data:`ENGINE_NAME` in vLLM's factories (again: a no-op)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, SharedMemoryWeightTransferEngine)
    if ENGINE_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(ENGINE_NAME, SharedMemoryTrainerEngine)
