"""Where each engine of a run runs on CUDA: its GPU, and the memory it must find free there when it starts.

Each engine of a dual engine (one per model of the roster) runs on one GPU (lockstep refuses tensor parallelism).
They may share one GPU or take one each, in any grouping:

- **Its GPU** reaches the engine through its processes' environment: vLLM reads ``CUDA_VISIBLE_DEVICES`` when its
  processes start, so the pair starts each engine with that variable set to its one device (``teacher_device``,
  ``theta_device``, with several teachers one entry of ``teacher_device`` per teacher: indices in this process's own
  numbering, which a ``CUDA_VISIBLE_DEVICES`` of this process maps to physical ids first).
- **Its share** is vLLM's ``gpu_memory_utilization``. The pair fixes each engine's KV cache
  (``kv_cache_memory_bytes``, sized so nothing is ever preempted), and with a fixed cache vLLM sizes nothing from the
  share: an engine takes its weights, its cache and its activations whatever the share says. What the share still
  does is gate the start: the worker refuses to start unless the GPU has share × its memory free at that moment
  (``vllm/v1/worker/utils.py``, ``request_memory``). The engines on one GPU start at once, so any of them may find
  the others' weights and caches already there. Unset, an engine's share is its own need (weights at its dtype and its
  KV cache) over its GPU's memory: the least that lets it start where it can run.

The arithmetic is checked before any engine starts, and a layout that cannot start is refused by name: the needs of
the engines on one GPU must fit its memory together, and each engine's share, with the other engines' needs taken
out first, must fit too. Each refusal names the setting as the user gave it (``teacher_device['math']`` for one of
several teachers: :func:`~dual_sampling.options.model_setting`). The needs are lower bounds (activations and CUDA
contexts come on top, and memory other processes hold is not seen here): vLLM's own gate and its first allocation
are the final word.

Where the engines sit decides how the followers' rows reach the leader (``row_transport="auto"``): through a buffer
on the leader's GPU when a pair shares it, through page-locked host memory otherwise (that buffer holds one
follower's rows, so several teachers always take host memory).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dual_sampling.driver import weights
from dual_sampling.modes import mode_of
from dual_sampling.options import ENGINE_DTYPE_BYTES, EngineOptions, ModelEngine, model_setting
from dual_sampling.roster import THETA, Roster

__all__ = [
    "EnginePlace",
    "check_placement_settings",
    "engine_dtype",
    "engine_need_bytes",
    "plan_placement",
    "weight_bytes",
]


@dataclass(frozen=True)
class EnginePlace:
    """One engine's place: its GPU (by this process's numbering), the ``CUDA_VISIBLE_DEVICES`` its processes get,
    and the share of that GPU's memory it must find free at start (vLLM's ``gpu_memory_utilization``)."""

    device: int
    visible_devices: str
    memory_share: float


def weight_bytes(folder: str | Path, dtype: str) -> int:
    """Bytes the weights of the model in ``folder`` take in an engine of ``dtype``, from the safetensors headers of
    the files vLLM loads (:func:`weights.loaded_files`): the plain floating tensors (:data:`weights.FLOAT_BYTES`) at
    ``dtype``'s size, which vLLM casts them to; the others (integer, packed, float8 and narrower) as stored.
    ValueError naming the file and tensor for a dtype the safetensors format does not define."""
    engine_bytes = ENGINE_DTYPE_BYTES.get(dtype)
    total = 0
    for path in weights.loaded_files(folder):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            bits = weights.DTYPE_BITS.get(entry["dtype"])
            if bits is None:
                raise ValueError(f"{path}: {name!r} has dtype {entry['dtype']!r}, which safetensors does not define")
            if engine_bytes and entry["dtype"] in weights.FLOAT_BYTES:
                bits = 8 * engine_bytes
            total += -(-math.prod(entry["shape"]) * bits // 8)  # a packed tensor fills whole bytes
    return total


def engine_dtype(cfg: EngineOptions, model: ModelEngine) -> str:
    """The dtype ``model``'s engine runs in, by name: its engine arguments' or the run's (a ``torch.dtype`` given
    there named as vLLM reads it, ``torch.bfloat16`` as ``bfloat16``)."""
    given = model.engine_kwargs.get("dtype", cfg.dtype)
    return str(given).removeprefix("torch.")


def engine_need_bytes(models: list[str], dtype: str, kv_cache_bytes: int) -> int:
    """The least memory an engine can run in: the weights of ``models`` (the teacher's, and in the speculative mode
    theta's too) at ``dtype``, and the KV cache the pair gives it."""
    return sum(weight_bytes(model, dtype) for model in models) + kv_cache_bytes


def _given_share(model: ModelEngine) -> float | None:
    """The share of its GPU ``model``'s engine was given: its ``*_gpu_memory``, or ``gpu_memory_utilization`` in its
    engine arguments (never both: :func:`check_placement_settings`)."""
    return model.engine_kwargs.get("gpu_memory_utilization") if model.gpu_memory is None else model.gpu_memory


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def plan_placement(
    models: tuple[ModelEngine, ...],
    roster: Roster,
    needs: dict[str, int],
    gpu_bytes: list[int],
    visible: str | None,
) -> dict[str, EnginePlace]:
    """Each started engine's place by model name, or ValueError naming the setting that makes the layout impossible.

    ``models``: the models whose engines start (every model of ``roster`` in lockstep; the teacher alone in the
    speculative mode); ``needs``: the bytes each needs at least, by name (:func:`engine_need_bytes`); ``gpu_bytes``:
    each GPU's memory, by this process's numbering; ``visible``: this process's ``CUDA_VISIBLE_DEVICES`` (None:
    unset). See the module docstring for what the shares mean and what is checked.
    """
    if not gpu_bytes:
        raise ValueError("teacher_device/theta_device: no CUDA device is visible to this process")
    physical = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(len(gpu_bytes))]
    devices: dict[str, int] = {}
    for model in models:
        device = 0 if model.device is None else model.device
        if not 0 <= device < len(gpu_bytes):
            raise ValueError(
                f"{model_setting(roster, model.name, 'device')}={device}: this process sees {len(gpu_bytes)} CUDA "
                f"device(s), 0 to {len(gpu_bytes) - 1}"
            )
        devices[model.name] = device
    shares: dict[str, float] = {}
    for device in sorted(set(devices.values())):
        on_it = [m for m in models if devices[m.name] == device]
        total = gpu_bytes[device]
        if sum(needs[m.name] for m in on_it) > total:
            each = " and ".join(f"the {m.name} engine {_gib(needs[m.name])}" for m in on_it)
            move = "theta" if any(m.name == THETA for m in on_it) and len(on_it) > 1 else on_it[-1].name
            raise ValueError(
                f"GPU {device} has {_gib(total)}; {each} need more at least (weights and KV cache): place {move} on "
                f"another GPU ({model_setting(roster, move, 'device')}), or lower max_num_seqs or max_model_len"
            )
        for model in on_it:
            given = _given_share(model)
            share = min(1.0, needs[model.name] / total) if given is None else given
            others = sum(needs[m.name] for m in on_it if m is not model)
            if share * total + others > total:
                raise ValueError(
                    f"{model_setting(roster, model.name, 'gpu_memory')}={share:.2f} asks GPU {device} "
                    f"({_gib(total)}) for {_gib(share * total)} free when the {model.name} engine starts, but the "
                    f"other engines on it take at least {_gib(others)}: lower it to {(total - others) / total:.2f} "
                    "or less, or leave it unset"
                )
            shares[model.name] = share
    return {m.name: EnginePlace(devices[m.name], physical[devices[m.name]], shares[m.name]) for m in models}


def check_placement_settings(
    cfg: EngineOptions, models: tuple[ModelEngine, ...], roster: Roster, device_type: str
) -> None:
    """Refuse placement settings these engines cannot use: any on a platform other than CUDA, a share outside
    (0, 1), a share given twice (``*_gpu_memory`` and ``gpu_memory_utilization`` in the model's engine arguments),
    and theta's in the speculative mode (theta runs inside the teacher's engine). ``models``: every model of
    ``roster`` with its settings."""
    for model in models:
        for setting, value in (("device", model.device), ("gpu_memory", model.gpu_memory)):
            name = model_setting(roster, model.name, setting)
            if value is None:
                continue
            if device_type != "cuda":
                raise ValueError(
                    f"{name}={value!r} places an engine on a CUDA device; these engines run on {device_type!r}"
                )
            if model.name == THETA and not mode_of(cfg.mode).theta_engine:
                raise ValueError(
                    f"{name}: in mode={cfg.mode!r} theta runs in the teacher's engine (use teacher_{setting})"
                )
        if model.gpu_memory is not None and "gpu_memory_utilization" in model.engine_kwargs:
            share = model_setting(roster, model.name, "gpu_memory")
            raise ValueError(
                f"{share} and {model_setting(roster, model.name, 'engine_kwargs')}['gpu_memory_utilization'] both set "
                f"the {model.name} engine's share of its GPU; set one"
            )
