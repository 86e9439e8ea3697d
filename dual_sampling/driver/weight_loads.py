"""How checked weights reach a running engine: the load step of an update (:data:`Load`), which the driver runs
between vLLM's pause and resume.

A state dict goes through vLLM's weight-transfer protocol (``start_weight_update``, ``update_weights``,
``finish_weight_update``) with the shared-memory engine of :mod:`processors.weight_transfer`: the tensors are
written once into a file of /dev/shm that the engine's workers map and load (:func:`transfer`). Tensors passed
straight through vLLM's ``collective_rpc`` would arrive as lists on the CPU build, which is why a channel of files
is needed. A folder is staged as a private copy (:func:`~dual_sampling.driver.weights.staged_folder`) and reloaded
by vLLM's ``reload_weights`` through our worker extension (:func:`reload_from`); for θ drafting inside the teacher's
engine (``mode="speculative"``), which vLLM updates only through a weight-transfer engine, its tensors are sent as a
chunk too. Either way tied output projections are refreshed after the load (vLLM's reload leaves them stale on the
CPU; :mod:`processors.weights_reload`).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

from dual_sampling.driver.weights import WeightsCheck, staged_folder

__all__ = ["Load", "chunk_of", "prepared_update", "reload_from", "transfer"]

Load = Callable[[Any], Coroutine[Any, Any, None]]
"""The load step of an update: given the engine, loads the new weights into it (the driver runs it between vLLM's
pause and resume)."""


@contextlib.contextmanager
def prepared_update(
    check: WeightsCheck, weights: Any, role: str, follow_symlinks: bool = True, draft: bool = False
) -> Iterator[Load]:
    """The load step of an update to ``weights`` (a folder or a state dict), checked against ``check`` first
    (ValueError naming the tensor; nothing written, no engine touched) and staged as a private copy.

    A state dict goes through the shared-memory weight-transfer engine (:func:`transfer`): one chunk file, loaded by
    vLLM's start, update and finish. A folder's files are staged (:func:`staged_folder`) and reloaded by vLLM's
    ``reload_weights``, or, for a ``draft`` model (θ drafting inside the teacher's engine, which vLLM reloads only
    through a weight-transfer engine), sent as a chunk too.
    """
    if isinstance(weights, (str, Path)):
        with staged_folder(check, weights, role, follow_symlinks) as folder:
            if not draft:
                yield reload_from(folder)
                return
            from safetensors.torch import load_file

            tensors = {}
            for path in sorted(folder.glob("*.safetensors")):
                tensors.update(load_file(path))
            with chunk_of(tensors.items(), f"{role} weights") as info:
                yield transfer(info, draft=draft)
        return
    with chunk_of(check.check_state_dict(weights, role).items(), f"{role} weights") as info:
        yield transfer(info, draft=draft)


@contextlib.contextmanager
def chunk_of(tensors: Iterable[tuple[str, Any]], what: str = "weights") -> Iterator[dict[str, Any]]:
    """``tensors`` written into one chunk file of the shared-memory weight-transfer engine, in a private folder (of
    /dev/shm when it has room) removed on exit; yields the chunk's ``update_info``. ValueError naming ``what`` when
    there is no room."""
    from processors.weight_transfer import weights_folder, write_chunk

    tensors = list(tensors)
    folder = weights_folder(sum(t.numel() * t.element_size() for _, t in tensors), what)
    try:
        yield write_chunk(tensors, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def transfer(*chunks: dict[str, Any], draft: bool = False) -> Load:
    """The load step that sends ``chunks`` (``update_info`` dicts) through the engine's weight-transfer engine:
    vLLM's ``start_weight_update`` (``start_draft_weight_update`` for the ``draft`` model), one ``update_weights``
    per chunk, ``finish_weight_update``."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    async def load(engine: Any) -> None:
        await (engine.start_draft_weight_update() if draft else engine.start_weight_update())
        for info in chunks:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        await engine.finish_weight_update()

    return load


def reload_from(folder: Path) -> Load:
    """The load step of an update from a staged folder: the engine's workers reload their weights in place from
    ``folder`` (vLLM's ``reload_weights``, then tied projections refreshed)."""
    from processors.worker_extension import DualSamplingWorkerExtension

    method = DualSamplingWorkerExtension.dual_sampling_reload_weights.__name__

    async def load(engine: Any) -> None:
        await engine.collective_rpc(method, kwargs={"weights_path": str(folder)})

    return load
