"""vLLM's weight-sync client surface on one model of a running dual engine: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` (one chunk per call) and ``finish_weight_update``.

These are the four methods of vLLM's ``VLLMWeightSyncClient`` protocol (``vllm/distributed/weight_transfer/base.py``),
which its trainer-side engines drive and which the server's routes of the same names call. So a trainer can push
weights in-process (``WeightTransferTrainerFactory.trainer_init(..., client=dual.weight_sync())``) or over HTTP with
the same code.

Why the chunks are held until finish, instead of loaded as they come as vLLM does: vLLM's layerwise reload cannot
be undone once started, and a chunk may be refused (a name the model lacks, a shape, a dtype, a NaN) or never come.
Each chunk's names and shapes are checked against the checkpoint first (so a chunk claiming a huge tensor reserves
nothing), then its tensors are copied into a private file (of /dev/shm when it has room) and their values checked:
a refused chunk is named and dropped, the chunks before it kept. ``finish_weight_update`` refuses an update that
misses a tensor, and only then does the engine see the chunks, through vLLM's start, update and finish on its
weight-transfer engine, between the driver's pause and resume like any update. So a refused update changes
nothing, at any step.

As vLLM's worker does, a start while an update is open is refused: two trainers (or a retry) would otherwise mix
their chunks into one model. A refused finish drops the update (a client that knows only the four methods starts
again after it, as TRL's does after an error); ``shutdown_weight_transfer_engine`` drops it too. One call at a time:
a call that finds another running (a finish waits for the requests in flight) is refused rather than queued.
A tied output projection a ``state_dict()`` lists is left out, as :meth:`~WeightsCheck.check_state_dict` does.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dual_sampling.driver.weight_loads import Load, transfer
from dual_sampling.driver.weights import WeightsCheck

__all__ = ["WeightSync"]


class WeightSync:
    """The weight-sync client of one model; thread-safe (one call at a time).

    ``apply(load, version)`` runs an update's load step on the driver (:meth:`OptimalSamplingDual.weight_sync` gives
    one that waits for the requests in flight as ``update_theta`` does) and returns the new version label. ``draft``:
    the model is its engine's draft model (vLLM's ``start_draft_weight_update``).
    """

    def __init__(
        self, check: WeightsCheck, role: str, apply: Callable[[Load, str | None], str], draft: bool = False
    ) -> None:
        self.check, self.role, self.draft = check, role, draft
        self._apply = apply
        self._lock = threading.Lock()
        self._folder: Path | None = None
        self._chunks: list[dict[str, Any]] = []
        self._received: set[str] = set()

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        """Check ``init_info``: the shared-memory engine needs none, so it must be empty (``{}``)."""
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info must be an object, got {type(init_info).__name__}")
        if init_info:
            raise ValueError(
                f"init_info.{sorted(init_info)[0]}: the shared-memory weight-transfer engine takes no init_info"
            )

    def start_weight_update(self) -> None:
        """Begin an update: chunks may come now. ValueError while one is open."""
        from processors.weight_transfer import weights_folder

        with self._one_call():
            if self._folder is not None:
                raise ValueError(
                    "an update is open: finish it (a refused finish drops it) or call shutdown_weight_transfer_engine"
                )
            # Room for the whole model in float32, the usual trainer's dtype (a chunk of another is checked on copy).
            self._folder = weights_folder(4 * self.check.numel, f"{self.role} weights")

    def update_weights(self, update_info: Any) -> None:
        """Take one chunk (vLLM's payload: a chunk's ``update_info``, or a list of one per worker, one here):
        checked by name and shape, copied, then checked by value; ValueError naming the tensor (the chunk dropped,
        those before kept)."""
        from processors.weight_transfer import chunk_info, copy_chunk, read_chunk

        if isinstance(update_info, list):
            if len(update_info) != 1:
                count = len(update_info)
                raise ValueError(f"update_info: a list holds one entry per worker; this engine has 1, not {count}")
            update_info = update_info[0]
        chunk = chunk_info(update_info)  # its form first: a malformed chunk is named as such, open update or not
        where = f"{self.role} weights"
        with self._one_call():
            if self._folder is None:
                raise ValueError("update_info: no update is open; call start_weight_update first")
            shapes = {
                name: tuple(shape)
                for name, shape in zip(chunk.names, chunk.shapes, strict=True)
                if self.check.kept(name)
            }
            if not shapes:
                return  # only a tied output projection: nothing the engine loads
            for name in shapes:
                if name in self._received:
                    raise ValueError(f"{where}: {name!r} came in an earlier chunk of this update")
            self.check.check_part(shapes, where, self.role)  # before a byte is reserved for the copy
            info = copy_chunk(chunk, self._folder, f"chunk-{len(self._chunks)}", keep=shapes)
            try:
                self.check.check_state_dict(dict(read_chunk(info)), self.role, shapes=False)
            except BaseException:
                Path(info["path"]).unlink(missing_ok=True)
                raise
            self._chunks.append(info)
            self._received.update(shapes)

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Load the update's chunks into the engine, labelled ``weight_version`` (default: the count of updates);
        returns the label. ValueError naming a tensor no chunk held; a refused or failed finish drops the update."""
        with self._one_call():
            if self._folder is None:
                raise ValueError("no update is open; call start_weight_update first")
            try:
                self.check.check_complete(self._received, f"{self.role} weights", self.role)
                return self._apply(transfer(*self._chunks, draft=self.draft), weight_version)
            finally:
                self._drop()

    def shutdown_weight_transfer_engine(self) -> None:
        """Drop an unfinished update; the engine is unchanged. (A call that finds another running is refused.)"""
        with self._one_call():
            self._drop()

    @property
    def updating(self) -> bool:
        """Whether an update is open (started, not finished)."""
        return self._folder is not None

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise ValueError("another weight-sync call is running (a finish waits for the requests in flight)")
        try:
            yield
        finally:
            self._lock.release()

    def _drop(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder, self._chunks, self._received = None, [], set()
