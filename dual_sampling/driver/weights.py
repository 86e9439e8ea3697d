"""New weights for a running engine, checked against the model's checkpoint and staged as a private copy
(:mod:`dual_sampling.driver.weight_loads` hands them to the engine).

Every update is checked before anything changes: each tensor's name and shape must be those
of the checkpoint the engine was started from (read from its safetensors headers, no weights
loaded), none may be missing, none extra, every dtype float16, bfloat16, float32 or float64 and every value finite.
The error names the tensor (and the file, for a folder). The checks run before vLLM's start: a layerwise reload
cannot be undone once begun.

A folder is never loaded where it lies. Its files are those vLLM's loader would read (:func:`_weight_files`: its
glob, which skips hidden names, its ``consolidated*`` rule and its index filter); any other ``*.safetensors`` file
is refused by name, since its tensors would pass the check and never load. The folder is opened once and each file
below its descriptor (without following a symlink, for the server: no part of the path may have been swapped for a
link since the server resolved it), each must be a regular file (a FIFO cannot hang the check), and every header is
checked (names, shapes, dtypes) before a byte is copied: a file must be exactly as long as its header says, so the
copy's size is bounded by the checkpoint's shapes. The files are then copied, that many bytes each, into a private
staging folder, whose values are checked tensor by tensor, and the engine loads the copy. So a trainer rewriting
the folder while the engines drain cannot slip an unchecked file in, a tensor in two files is refused instead of the
last file silently winning, and a file that grows (or is sparse) cannot fill the disk or /dev/shm.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import json
import math
import os
import shutil
import stat
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processors.weight_transfer import weights_folder

__all__ = [
    "DTYPE_BITS",
    "FLOAT_BYTES",
    "WeightsCheck",
    "loaded_files",
    "staged_folder",
]

_TIED_OUTPUT = "lm_head.weight"
"""The output projection, which a checkpoint with tied word embeddings does not store."""
_DTYPES_BY_BITS = {
    4: "F4",
    6: "F6_E2M3 F6_E3M2",
    8: "BOOL U8 I8 F8_E4M3 F8_E5M2 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ",
    16: "U16 I16 F16 BF16",
    32: "U32 I32 F32",
    64: "U64 I64 F64 C64",
}
DTYPE_BITS = {dtype: bits for bits, dtypes in _DTYPES_BY_BITS.items() for dtype in dtypes.split()}
"""Bits per element of every dtype the safetensors format defines (its 22, as of safetensors 0.8). Bits, not bytes:
F4 and F6 pack several elements to a byte, and a header's shape counts elements."""
FLOAT_BYTES = {dtype: DTYPE_BITS[dtype] // 8 for dtype in ("F16", "BF16", "F32", "F64")}
"""The plain floating dtypes and their sizes in bytes: those vLLM casts to an engine's dtype when it loads them
(float8 and narrower are quantised storage, kept as stored), and the only ones new weights may have."""
_HEADERS_MAX = 100_000_000
"""Bytes of safetensors headers a folder may hold in all (safetensors' own limit for one file)."""
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class WeightsCheck:
    """The tensor names and shapes of one model folder's checkpoint, to check new weights against."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.shapes = _checkpoint_shapes(self.folder)
        config = json.loads((self.folder / "config.json").read_text()) if (self.folder / "config.json").exists() else {}
        self.tied = bool(config.get("tie_word_embeddings", False))

    def check_state_dict(self, state: Mapping[str, Any], role: str, shapes: bool = True) -> dict[str, Any]:
        """The tensors to write (a tied output projection dropped); ValueError naming the first bad tensor.

        ``shapes=False`` checks only dtypes and values (for a part of a checkpoint whose names and shapes were
        checked already)."""
        import torch

        if not isinstance(state, Mapping) or not state:
            raise ValueError(f"the new {role} weights must be a non-empty mapping of tensor names to tensors")
        out = {name: t for name, t in state.items() if self.kept(name)}
        for name, tensor in out.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{role} weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if shapes:
            self._check_shapes({name: tuple(t.shape) for name, t in out.items()}, f"{role} weights", role)
        floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        for name, tensor in out.items():
            if tensor.dtype not in floats:  # float8 too: torch has no amax for it, so its values cannot be checked
                allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in floats)
                raise ValueError(f"{role} weights: {name!r} has dtype {tensor.dtype}, not one of {allowed}")
            # The extremes are NaN if any value is, and ±inf if any is: two reductions, no tensor-sized mask.
            if tensor.numel() and not bool(torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all()):
                raise ValueError(f"{role} weights: {name!r} holds a NaN or an infinity")
        return out

    @property
    def numel(self) -> int:
        """Elements in the checkpoint's tensors, all together."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    def kept(self, name: str) -> bool:
        """Whether an update keeps tensor ``name``: all but a tied output projection the checkpoint leaves out
        (``state_dict()`` lists it; the engine shares the embedding)."""
        return not (name == _TIED_OUTPUT and self.tied and name not in self.shapes)

    def _check_shapes(self, shapes: Mapping[str, tuple[int, ...]], where: str, role: str) -> None:
        """No tensor missing, none extra, each of the checkpoint's shape; ValueError naming the first that is not."""
        self.check_part(shapes, where, role)
        self.check_complete(shapes, where, role)

    def check_part(self, shapes: Mapping[str, tuple[int, ...]], where: str, role: str) -> None:
        """Each tensor of a part of an update one of the checkpoint, of its shape; ValueError naming the first not."""
        for name in sorted(shapes):
            if name not in self.shapes:
                raise ValueError(f"{where}: {name!r} is not a tensor of the {role} model")
            if shapes[name] != self.shapes[name]:
                raise ValueError(f"{where}: {name!r} has shape {shapes[name]}, the model's is {self.shapes[name]}")

    def check_complete(self, names: Collection[str], where: str, role: str) -> None:
        """ValueError naming the first of the checkpoint's tensors not in ``names``."""
        missing = sorted(set(self.shapes) - set(names))
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(f"{where}: {missing[0]!r}{more} missing")


@contextlib.contextmanager
def staged_folder(check: WeightsCheck, source: str | Path, role: str, follow_symlinks: bool = True) -> Iterator[Path]:
    """A private copy of the safetensors files vLLM would load from ``source``, checked as a state dict is; removed
    on exit.

    ValueError naming the file (and the tensor) for: a ``*.safetensors`` file vLLM's loader would skip (a hidden
    name, one beside ``consolidated*`` files, one its index leaves out), a file that is not a regular file (a FIFO,
    a device), a symlink unless ``follow_symlinks`` (a Hugging Face cache snapshot is links; the server refuses
    them, in the folder's own path too), one that cannot be read as safetensors or whose size is not the one its
    header describes, a tensor in two files, every check of :meth:`WeightsCheck.check_state_dict` (names, shapes,
    dtypes, finite values), and no room to stage the copy.
    """
    source = Path(source).absolute()
    what = f"{role} weights"
    with contextlib.ExitStack() as opened:
        try:
            folder_fd = _open_folder(source, follow_symlinks)
        except OSError as exc:
            raise ValueError(f"{what}: cannot open the folder {source}: {exc.strerror or exc}") from exc
        opened.callback(os.close, folder_fd)
        names, skipped = _weight_files(folder_fd, source, what, follow_symlinks)
        if skipped:
            name = sorted(skipped)[0]
            raise ValueError(f"{what}: {source / name} is {skipped[name]}: its tensors would never load")
        if not names:
            raise ValueError(f"{what}: {source} holds no .safetensors files")
        files = {}
        for name in names:
            files[name] = _open_regular(folder_fd, name, source, what, follow_symlinks)
            opened.callback(os.close, files[name])
        headers = _checked_headers(check, files, source, role)
        total = sum(header.size for header in headers.values())
        folder = weights_folder(total, what)
        try:
            for name, fd in files.items():
                _copy_checked(fd, headers[name], folder / name, source / name, what, total)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    try:
        _check_staged(check, folder, source, names, role)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _open_folder(path: Path, follow_symlinks: bool) -> int:
    """A descriptor of the folder at absolute ``path``. Without ``follow_symlinks`` each part of the path is opened
    below the last one's descriptor and never through a symlink: a folder swapped for a link after the server
    resolved the path is refused, not followed out of the folders it may read."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    if follow_symlinks:
        return os.open(path, flags)
    fd = os.open(path.anchor, flags)
    try:
        for part in path.parts[1:]:
            try:
                child = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(exc.errno, f"{part!r} in its path is a symlink") from exc
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _weight_files(folder_fd: int, folder: Path, what: str, follow_symlinks: bool) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of the folder open as ``folder_fd`` that vLLM's loader reads, and each other
    ``*.safetensors`` name in it with why the loader skips it.

    vLLM's ``DefaultModelLoader._prepare_weights`` (load format "auto"): ``glob.glob("*.safetensors")``, which skips
    hidden names; only ``consolidated*.safetensors`` when one exists (Mistral's format); then, when the folder has
    the index of that format, only the files it maps tensors to. ValueError for an unreadable index.
    """
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

    every = fnmatch.filter(os.listdir(folder_fd), "*.safetensors")
    loaded = glob.glob("*.safetensors", dir_fd=folder_fd)
    index_name = SAFE_WEIGHTS_INDEX_NAME
    if consolidated := glob.glob("consolidated*.safetensors", dir_fd=folder_fd):
        loaded, index_name = consolidated, "consolidated.safetensors.index.json"
    index = _indexed_files(folder_fd, index_name, folder, what, follow_symlinks)
    if index is not None:
        loaded = [name for name in loaded if name in index]
    skipped = {}
    for name in set(every) - set(loaded):
        if name.startswith("."):
            skipped[name] = "a hidden file, which vLLM's loader skips"
        elif consolidated and name not in consolidated:
            skipped[name] = "beside consolidated*.safetensors files, which vLLM's loader then reads alone"
        else:
            skipped[name] = f"not in {index_name}, which vLLM's loader reads only the files of"
    return sorted(loaded), skipped


def _indexed_files(folder_fd: int, index_name: str, folder: Path, what: str, follow_symlinks: bool) -> set[str] | None:
    """The file names an index maps tensors to (None where the folder has no such index); ValueError naming it."""
    try:
        os.stat(index_name, dir_fd=folder_fd, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    except OSError:
        pass  # named by _open_regular just below
    fd = _open_regular(folder_fd, index_name, folder, what, follow_symlinks)
    try:
        size = os.fstat(fd).st_size
        if size > _HEADERS_MAX:
            raise ValueError(f"{what}: {folder / index_name} is {size} bytes, over {_HEADERS_MAX}")
        try:
            weight_map = json.loads(_read_at(fd, size, 0))["weight_map"]
            return {str(file) for file in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{what}: {folder / index_name} is not an index with a weight_map: {exc}") from None
    finally:
        os.close(fd)


def _open_regular(folder_fd: int, name: str, folder: Path, what: str, follow_symlinks: bool) -> int:
    """A blocking read descriptor of the regular file ``name`` below ``folder_fd`` (reached without a symlink unless
    ``follow_symlinks``); else ValueError naming it."""
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it is refused just below.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=folder_fd)
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP and not follow_symlinks else (exc.strerror or str(exc))
        raise ValueError(f"{what}: {folder / name} {why}: only regular files are loaded") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{what}: {folder / name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


@dataclass(frozen=True)
class _Header:
    """One safetensors file's header: its bytes as read (the 8-byte length first) and each tensor's dtype and shape."""

    raw: bytes
    tensors: dict[str, tuple[str, tuple[int, ...]]]

    @property
    def size(self) -> int:
        """The file's length in bytes, as its header describes it (its dtypes checked first)."""
        return len(self.raw) + sum(FLOAT_BYTES[dtype] * math.prod(shape) for dtype, shape in self.tensors.values())


def _read_at(fd: int, count: int, offset: int) -> bytes:
    """Up to ``count`` bytes of ``fd`` from ``offset`` (fewer only at the end of the file)."""
    chunks = []
    while count > 0 and (chunk := os.pread(fd, count, offset)):
        chunks.append(chunk)
        count, offset = count - len(chunk), offset + len(chunk)
    return b"".join(chunks)


def _read_header(fd: int, path: Path, budget: int) -> _Header:
    """The header of the safetensors file open as ``fd``, of at most ``budget`` bytes; ValueError naming ``path``."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError(f"{path} is not valid safetensors: {size} bytes, too few for its header's length")
    length = int.from_bytes(_read_at(fd, 8, 0), "little")
    if 8 + length > min(size, 8 + budget):
        raise ValueError(f"{path} is not valid safetensors: a header of {length} bytes in a file of {size}")
    raw = _read_at(fd, 8 + length, 0)
    try:
        header = json.loads(raw[8:])
    except ValueError as exc:
        raise ValueError(f"{path} is not valid safetensors: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not valid safetensors: its header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{path} is not valid safetensors: {name!r} has no dtype and shape")
        tensors[name] = (dtype, tuple(shape))
    return _Header(raw, tensors)


def _checked_headers(check: WeightsCheck, files: Mapping[str, int], source: Path, role: str) -> dict[str, _Header]:
    """Each file's header, checked before anything is copied: names and shapes as :meth:`WeightsCheck._check_shapes`,
    no tensor in two files, every dtype in :data:`FLOAT_BYTES`, and each file (``fstat``) exactly as long as its
    header says. So the copy is bounded by the checkpoint's shapes. ValueError naming the file and the tensor."""
    what = f"{role} weights"
    headers: dict[str, _Header] = {}
    found: dict[str, str] = {}  # tensor → the file holding it
    budget = _HEADERS_MAX
    for name, fd in files.items():
        try:
            header = headers[name] = _read_header(fd, source / name, budget)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        budget -= len(header.raw)
        if not header.tensors:
            raise ValueError(f"{what}: {source / name} holds no tensors")
        for tensor in header.tensors:
            if tensor in found:
                raise ValueError(f"{what} in {source}: {tensor!r} is in both {found[tensor]} and {name}")
            found[tensor] = name
    shapes = {tensor: shape for header in headers.values() for tensor, (_, shape) in header.tensors.items()}
    check._check_shapes(shapes, f"{what} in {source}", role)
    for tensor in sorted(found):
        dtype = headers[found[tensor]].tensors[tensor][0]
        if dtype not in FLOAT_BYTES:
            allowed = ", ".join(FLOAT_BYTES)
            raise ValueError(
                f"{what}: {tensor!r} has dtype {dtype}, not one of {allowed} (in {source / found[tensor]})"
            )
    for name, fd in files.items():
        size, described = os.fstat(fd).st_size, headers[name].size
        if size != described:
            raise ValueError(f"{what}: {source / name} is {size} bytes, but its header describes {described}")
    return headers


def _copy_checked(fd: int, header: _Header, target: Path, source: Path, what: str, total: int) -> None:
    """Write ``header`` (the bytes checked) then the data after it in ``fd`` to the new file ``target``:
    ``header.size`` bytes in all, however much the file grew since. ValueError naming ``source``; a full disk says
    so (``total``: the bytes of the whole copy)."""
    try:
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(out, "wb") as dst:
            dst.write(header.raw)
            dst.flush()
            offset = len(header.raw)
            while offset < header.size:
                sent = os.sendfile(out, fd, offset, header.size - offset)
                if not sent:
                    raise ValueError(f"{what}: {source} shrank while it was copied")
                offset += sent
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise ValueError(
                f"{what}: no room left in {target.parent.parent} to stage a copy of {total} bytes"
                f" ({exc.strerror}); nothing was loaded"
            ) from exc
        raise ValueError(f"{what}: copying {source} failed: {exc.strerror or exc}") from exc


def _check_staged(check: WeightsCheck, folder: Path, source: Path, names: list[str], role: str) -> None:
    """The staged files' tensors, one at a time, through the dtype and value checks (their names, shapes and dtypes
    passed :func:`_checked_headers`, which wrote these very headers); ValueError naming file and tensor."""
    from safetensors import SafetensorError, safe_open

    try:
        for name in names:
            with safe_open(str(folder / name), framework="pt") as f:  # checks the data offsets against the header
                for tensor in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    try:
                        check.check_state_dict({tensor: f.get_tensor(tensor)}, role, shapes=False)
                    except ValueError as exc:
                        raise ValueError(f"{exc} (in {source / name})") from None
    except SafetensorError as exc:
        raise ValueError(f"{role} weights in {source}: a file is not valid safetensors: {exc}") from exc


def loaded_files(folder: str | Path) -> list[Path]:
    """The safetensors files of the model folder ``folder`` that vLLM's loader reads (:func:`_weight_files`), sorted
    by name; ValueError naming the folder when it cannot be opened, or its index when that cannot be read."""
    folder = Path(folder)
    try:
        fd = _open_folder(folder.absolute(), follow_symlinks=True)
    except OSError as exc:
        raise ValueError(f"cannot open the model folder {folder}: {exc.strerror or exc}") from exc
    try:
        names, _ = _weight_files(fd, folder, "the model", follow_symlinks=True)
    finally:
        os.close(fd)
    return [folder / name for name in names]


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape over the safetensors files of ``folder`` that vLLM loaded (headers only)."""
    from safetensors import safe_open

    paths = loaded_files(folder)
    if not paths:
        raise ValueError(f"{folder} holds no .safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for tensor in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                shapes[tensor] = tuple(f.get_slice(tensor).get_shape())
    return shapes
