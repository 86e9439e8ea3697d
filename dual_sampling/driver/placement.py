"""Where each engine of a pair runs on CUDA: its GPU, and the memory it must find free there when it starts.

Each engine of a dual engine runs on one GPU (lockstep refuses tensor parallelism). The two may share one GPU or
take one each:

- **Its GPU** reaches the engine through its processes' environment: vLLM reads ``CUDA_VISIBLE_DEVICES`` when its
  processes start, so the pair starts each engine with that variable set to its one device (``teacher_device``,
  ``theta_device``: indices in this process's own numbering, which a ``CUDA_VISIBLE_DEVICES`` of this process maps
  to physical ids first).
- **Its share** is vLLM's ``gpu_memory_utilization``. The pair fixes each engine's KV cache
  (``kv_cache_memory_bytes``, sized so nothing is ever preempted), and with a fixed cache vLLM sizes nothing from the
  share: an engine takes its weights, its cache and its activations whatever the share says. What the share still
  does is gate the start: the worker refuses to start unless the GPU has share × its memory free at that moment
  (``vllm/v1/worker/utils.py``, ``request_memory``). Two engines on one GPU start at once, so either may find the
  other's weights and cache already there. Unset, an engine's share is its own need (weights at its dtype and its
  KV cache) over its GPU's memory: the least that lets it start where it can run.

The arithmetic is checked before any engine starts, and a layout that cannot start is refused by name: the needs of
the engines on one GPU must fit its memory together, and each engine's share, with the other engines' needs taken
out first, must fit too. The needs are lower bounds (activations and CUDA contexts come on top, and memory other
processes hold is not seen here): vLLM's own gate and its first allocation are the final word.

Where the engines sit decides how theta's rows reach the teacher (``row_transport="auto"``): through a buffer on the
teacher's GPU when both share it, through page-locked host memory when they do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dual_sampling.driver import weights
from dual_sampling.modes import mode_of
from dual_sampling.options import ENGINE_DTYPE_BYTES, EngineOptions, ModelEngine
from dual_sampling.roster import Role

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


def _given_share(cfg: EngineOptions, role: Role) -> float | None:
    """The share of its GPU ``role``'s engine was given: ``*_gpu_memory``, or ``gpu_memory_utilization`` in its
    ``*_engine_kwargs`` (never both: :func:`check_placement_settings`)."""
    kwargs = role.pick(cfg.teacher_engine_kwargs, cfg.theta_engine_kwargs)
    given = getattr(cfg, f"{role}_gpu_memory")
    return kwargs.get("gpu_memory_utilization") if given is None else given


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def plan_placement(
    cfg: EngineOptions,
    roles: tuple[Role, ...],
    needs: dict[Role, int],
    gpu_bytes: list[int],
    visible: str | None,
) -> dict[Role, EnginePlace]:
    """Each engine's place, or ValueError naming the setting that makes the layout impossible.

    ``roles``: the engines started (both in lockstep; the teacher alone in the speculative mode); ``needs``: the
    bytes each needs at least (:func:`engine_need_bytes`); ``gpu_bytes``: each GPU's memory, by this process's
    numbering; ``visible``: this process's ``CUDA_VISIBLE_DEVICES`` (None: unset). See the module docstring for
    what the shares mean and what is checked.
    """
    if not gpu_bytes:
        raise ValueError("teacher_device/theta_device: no CUDA device is visible to this process")
    physical = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(len(gpu_bytes))]
    devices: dict[Role, int] = {}
    for role in roles:
        name = f"{role}_device"
        device = getattr(cfg, name)
        device = 0 if device is None else device
        if not 0 <= device < len(gpu_bytes):
            raise ValueError(
                f"{name}={device}: this process sees {len(gpu_bytes)} CUDA device(s), 0 to {len(gpu_bytes) - 1}"
            )
        devices[role] = device
    shares: dict[Role, float] = {}
    for device in sorted(set(devices.values())):
        on_it = [r for r in roles if devices[r] == device]
        total = gpu_bytes[device]
        if sum(needs[r] for r in on_it) > total:
            each = " and ".join(f"the {r} engine {_gib(needs[r])}" for r in on_it)
            raise ValueError(
                f"GPU {device} has {_gib(total)}; {each} need more at least (weights and KV cache): place theta on "
                "another GPU (theta_device), or lower max_num_seqs or max_model_len"
            )
        for role in on_it:
            given = _given_share(cfg, role)
            share = min(1.0, needs[role] / total) if given is None else given
            others = sum(needs[r] for r in on_it if r != role)
            if share * total + others > total:
                raise ValueError(
                    f"{role}_gpu_memory={share:.2f} asks GPU {device} ({_gib(total)}) for {_gib(share * total)} free "
                    f"when the {role} engine starts, but the other engine on it takes at least {_gib(others)}: lower "
                    f"it to {(total - others) / total:.2f} or less, or leave it unset"
                )
            shares[role] = share
    return {role: EnginePlace(devices[role], physical[devices[role]], shares[role]) for role in roles}


def check_placement_settings(cfg: EngineOptions, device_type: str) -> None:
    """Refuse placement settings these engines cannot use: any on a platform other than CUDA, a share outside
    (0, 1), a share given twice (``*_gpu_memory`` and ``gpu_memory_utilization`` in ``*_engine_kwargs``), and
    theta's in the speculative mode (theta runs inside the teacher's engine)."""
    for role in Role:
        for name in (f"{role}_device", f"{role}_gpu_memory"):
            value = getattr(cfg, name)
            if value is None:
                continue
            if device_type != "cuda":
                raise ValueError(
                    f"{name}={value!r} places an engine on a CUDA device; these engines run on {device_type!r}"
                )
            if role == Role.THETA and not mode_of(cfg.mode).theta_engine:
                raise ValueError(
                    f"{name}: in mode={cfg.mode!r} theta runs in the teacher's engine (use teacher_{name[6:]})"
                )
        kwargs: dict[str, Any] = role.pick(cfg.teacher_engine_kwargs, cfg.theta_engine_kwargs)
        if getattr(cfg, f"{role}_gpu_memory") is not None and "gpu_memory_utilization" in kwargs:
            raise ValueError(
                f"{role}_gpu_memory and {role}_engine_kwargs['gpu_memory_utilization'] both set the {role} engine's "
                "share of its GPU; set one"
            )
