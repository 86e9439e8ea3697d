"""New weights for a running engine: checked against the model's checkpoint, then handed over by path.

vLLM's worker reloads weights in place (``reload_weights(weights_path=...)`` through
``collective_rpc``), by way of our worker extension, which also refreshes a tied output
projection that vLLM's reload alone leaves stale on the CPU
(:mod:`processors.weights_reload`). Tensors passed straight through that RPC arrive as lists on the CPU
build, so a state dict travels as one safetensors file in a private folder (in /dev/shm when it
has room) that the engine loads by path; the folder is removed once it has.

Every update is checked before anything changes: each tensor's name and shape must be those
of the checkpoint the engine was started from (read from its safetensors headers, no weights
loaded), none may be missing, none extra, every dtype floating-point and every value finite.
The error names the tensor (and the file, for a folder).

A folder is never loaded where it lies: its ``*.safetensors`` files are copied into a private
staging folder first (each opened as a regular file, never through a symlink, so a FIFO or a
link planted in an allowed folder cannot hang the check or redirect it), the copy is checked
tensor by tensor, and the engine loads the copy. So a trainer rewriting the folder while the
engines drain cannot slip an unchecked file in, and a tensor in two files is refused instead
of the last file silently winning.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any

from dual_sampling.lockstep import SHM_DIR
from dual_sampling.lockstep.janitor import scratch_dir

__all__ = ["WeightsCheck", "prepared_weights", "reload_from", "staged_folder", "staged_weights"]

_TIED_OUTPUT = "lm_head.weight"
"""The output projection, which a checkpoint with tied word embeddings does not store."""


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
        # state_dict() lists a tied projection that the checkpoint leaves out (the engine shares the embedding).
        out = {
            name: t for name, t in state.items() if not (name == _TIED_OUTPUT and self.tied and name not in self.shapes)
        }
        for name, tensor in out.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{role} weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if shapes:
            self._check_shapes({name: tuple(t.shape) for name, t in out.items()}, f"{role} weights", role)
        for name, tensor in out.items():
            if not tensor.is_floating_point():
                raise ValueError(f"{role} weights: {name!r} has dtype {tensor.dtype}, not a floating-point type")
            # The extremes are NaN if any value is, and ±inf if any is: two reductions, no tensor-sized mask.
            if tensor.numel() and not bool(torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all()):
                raise ValueError(f"{role} weights: {name!r} holds a NaN or an infinity")
        return out

    def _check_shapes(self, shapes: Mapping[str, tuple[int, ...]], where: str, role: str) -> None:
        """No tensor missing, none extra, each of the checkpoint's shape; ValueError naming the first that is not."""
        for name in sorted(shapes):
            if name not in self.shapes:
                raise ValueError(f"{where}: {name!r} is not a tensor of the {role} model")
            if shapes[name] != self.shapes[name]:
                raise ValueError(f"{where}: {name!r} has shape {shapes[name]}, the model's is {self.shapes[name]}")
        missing = sorted(set(self.shapes) - set(shapes))
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(f"{where}: {missing[0]!r}{more} missing")


@contextlib.contextmanager
def staged_weights(tensors: Mapping[str, Any]) -> Iterator[Path]:
    """A private temporary folder holding ``tensors`` as one safetensors file, removed on exit."""
    from safetensors.torch import save_file

    folder = _staging_folder(sum(t.numel() * t.element_size() for t in tensors.values()))
    try:
        seen: set[int] = set()
        plain = {}
        for name, tensor in tensors.items():
            t = tensor.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # safetensors refuses tensors that share memory
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            plain[name] = t
        save_file(plain, str(folder / "model.safetensors"))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _staging_folder(size: int) -> Path:
    """A new private folder (mode 0700) for ``size`` bytes of weights: in /dev/shm when it has room (no disk write,
    and a cleanup finds it if this process dies), else in the temporary directory."""
    if shutil.disk_usage(SHM_DIR).free > 2 * size:
        return scratch_dir("weights")
    return Path(tempfile.mkdtemp(prefix="dual-sampling-weights-"))


@contextlib.contextmanager
def staged_folder(check: WeightsCheck, source: str | Path, role: str, follow_symlinks: bool = True) -> Iterator[Path]:
    """A private copy of the ``*.safetensors`` files of ``source``, checked as a state dict is; removed on exit.

    ValueError naming the file (and the tensor) for: a file that is not a regular file (a FIFO, a device), a symlink
    unless ``follow_symlinks`` (a Hugging Face cache snapshot is links; the server refuses them), one that cannot be
    read as safetensors, a tensor in two files, and every check of :meth:`WeightsCheck.check_state_dict` (names,
    shapes, dtypes, finite values).
    """
    source = Path(source)
    try:
        names = sorted(p.name for p in source.iterdir() if p.name.endswith(".safetensors"))
    except OSError as exc:
        raise ValueError(f"{role} weights: cannot list {source}: {exc.strerror or exc}") from exc
    if not names:
        raise ValueError(f"{role} weights: {source} holds no .safetensors files")
    folder = _staging_folder(sum(_size_of(source / name, follow_symlinks) for name in names))
    try:
        for name in names:
            _copy_regular_file(source / name, folder / name, role, follow_symlinks)
        _check_staged(check, folder, source, names, role)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _size_of(path: Path, follow_symlinks: bool) -> int:
    try:
        return (path.stat() if follow_symlinks else path.lstat()).st_size
    except OSError:
        return 0


def _copy_regular_file(source: Path, target: Path, role: str, follow_symlinks: bool) -> None:
    """Copy ``source`` to ``target`` if it is a regular file (reached without a symlink unless ``follow_symlinks``);
    else ValueError naming it."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it is refused just below.
    flags |= os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(source, flags)
    except OSError as exc:
        why = "is a symlink" if source.is_symlink() else (exc.strerror or str(exc))
        raise ValueError(f"{role} weights: {source} {why}: only regular files are loaded") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{role} weights: {source} is not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as src:
            try:
                dst = open(target, "wb")  # noqa: SIM115 (its errors are told apart from the source's)
            except OSError as exc:
                raise ValueError(f"{role} weights: cannot stage a copy in {target.parent}: {exc.strerror}") from exc
            with dst:
                try:
                    shutil.copyfileobj(src, dst, 1 << 24)
                except OSError as exc:
                    raise ValueError(f"{role} weights: copying {source} failed: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def _check_staged(check: WeightsCheck, folder: Path, source: Path, names: list[str], role: str) -> None:
    """The staged files' tensors, one at a time, through the state-dict checks; ValueError naming file and tensor."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, str] = {}
    try:
        for name in names:
            with safe_open(str(folder / name), framework="pt") as f:
                for tensor in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    if tensor in where:
                        both = f"{where[tensor]} and {name}"
                        raise ValueError(f"{role} weights in {source}: {tensor!r} is in both {both}")
                    where[tensor] = name
        # Shapes from the headers first (no tensor loaded), then each tensor's dtype and values.
        check._check_shapes(_checkpoint_shapes(folder), f"{role} weights in {source}", role)
        for name in names:
            with safe_open(str(folder / name), framework="pt") as f:
                for tensor in f.keys():  # noqa: SIM118
                    try:
                        check.check_state_dict({tensor: f.get_tensor(tensor)}, role, shapes=False)
                    except ValueError as exc:
                        raise ValueError(f"{exc} (in {source / name})") from None
    except SafetensorError as exc:
        raise ValueError(f"{role} weights in {source}: a file is not valid safetensors: {exc}") from exc


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape over every safetensors file of ``folder`` (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@contextlib.contextmanager
def prepared_weights(check: WeightsCheck, weights: Any, role: str, follow_symlinks: bool = True) -> Iterator[Path]:
    """The folder an engine loads ``weights`` from: a folder as given, or a state dict staged in a temporary one.

    Either is checked against ``check`` first (ValueError naming the tensor; nothing written), and either is a private
    copy: a folder's files are staged (:func:`staged_folder`).
    """
    if isinstance(weights, (str, Path)):
        with staged_folder(check, weights, role, follow_symlinks) as folder:
            yield folder
        return
    with staged_weights(check.check_state_dict(weights, role)) as folder:
        yield folder


def reload_from(folder: Path) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """The load step of an update: the engine's workers reload their weights in place from ``folder``."""
    from processors.worker_extension import DualSamplingWorkerExtension

    method = DualSamplingWorkerExtension.dual_sampling_reload_weights.__name__

    async def load(engine: Any) -> None:
        await engine.collective_rpc(method, kwargs={"weights_path": str(folder)})

    return load
