"""Where each engine of a pair runs on CUDA: its GPU, and its share of that GPU's memory.

Each engine of a dual engine runs on one GPU (lockstep refuses tensor parallelism). The two may share one GPU or
take one each:

- **Its GPU** reaches the engine through its processes' environment: vLLM reads ``CUDA_VISIBLE_DEVICES`` when its
  processes start, so the pair starts each engine with that variable set to its one device (``teacher_device``,
  ``theta_device``: indices in this process's own numbering, which a ``CUDA_VISIBLE_DEVICES`` of this process maps
  to physical ids first).
- **Its share** is vLLM's ``gpu_memory_utilization``: the fraction of the GPU's memory that engine may take in all
  (weights, KV cache, activations). Two vLLM engines on one GPU must split it: each one's default of 0.9 would leave
  the second nothing. Unset, an engine alone on its GPU takes :data:`GPU_MEMORY_BUDGET`, and two engines sharing one
  split that budget in proportion to what each needs.

The arithmetic is checked before any engine starts: every share in (0, 1), the shares on one GPU summing to at most
1, and each share holding at least its engine's weights (at the engine's dtype) and KV cache. That is a lower
bound, not a prediction: vLLM profiles its activations when it starts and refuses a share that is too small, seconds
later; the check here refuses, by name and at once, the layouts that cannot work at all.

Where the engines sit decides how theta's rows reach the teacher (``row_transport="auto"``): through a buffer on the
teacher's GPU when both share it, through page-locked host memory when they do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dual_sampling.lockstep.layout import Role
from dual_sampling.options import EngineOptions, default_kv_cache_bytes

__all__ = [
    "GPU_MEMORY_BUDGET",
    "EnginePlace",
    "check_placement_settings",
    "engine_dtype",
    "engine_need_bytes",
    "plan_placement",
    "weight_bytes",
]

GPU_MEMORY_BUDGET = 0.9
"""The share of a GPU the engines on it take together unless told (vLLM's own default for one engine)."""

GPU_BLOCK_SIZE = 16
"""vLLM's KV-cache block size on CUDA: the KV a share must hold is counted in whole blocks of it."""

_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I8": 1}
"""Bytes per element of the safetensors dtypes a checkpoint may hold."""

_ENGINE_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class EnginePlace:
    """One engine's place: its GPU (by this process's numbering), the ``CUDA_VISIBLE_DEVICES`` its processes get,
    and its share of that GPU's memory (vLLM's ``gpu_memory_utilization``)."""

    device: int
    visible_devices: str
    memory_share: float


def weight_bytes(folder: str | Path, dtype: str) -> int:
    """Bytes the weights of the model in ``folder`` take at ``dtype`` (floating tensors converted; others as
    stored), from the safetensors headers alone."""
    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            stored = _DTYPE_BYTES.get(entry["dtype"], 4)
            floating = entry["dtype"].startswith(("F", "BF"))
            total += math.prod(entry["shape"]) * (_ENGINE_DTYPE_BYTES.get(dtype, stored) if floating else stored)
    return total


def engine_dtype(cfg: EngineOptions, role: Role) -> str:
    """The dtype ``role``'s engine runs in: its ``*_engine_kwargs``' or the pair's."""
    return str(role.pick(cfg.teacher_engine_kwargs, cfg.theta_engine_kwargs).get("dtype", cfg.dtype))


def engine_need_bytes(cfg: EngineOptions, model: str, role: Role, max_model_len: int) -> int:
    """The least memory an engine of ``model`` can start in: its weights at its dtype and its KV cache
    (``kv_cache_memory_bytes``, or what the pair gives it by default)."""
    dtype = engine_dtype(cfg, role)
    kv = cfg.kv_cache_memory_bytes or default_kv_cache_bytes(
        model, cfg.max_num_seqs, max_model_len, dtype, GPU_BLOCK_SIZE
    )
    return weight_bytes(model, dtype) + kv


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
    numbering; ``visible``: this process's ``CUDA_VISIBLE_DEVICES`` (None: unset).
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
    for role in roles:
        given = _given_share(cfg, role)
        sharing = [r for r in roles if devices[r] == devices[role]]
        if given is None:
            unset = [r for r in sharing if _given_share(cfg, r) is None]
            room = GPU_MEMORY_BUDGET - sum(_given_share(cfg, r) for r in sharing if r not in unset)
            if room <= 0:
                others = ", ".join(f"{r}_gpu_memory" for r in sharing if r not in unset)
                raise ValueError(f"{others} leaves no memory of GPU {devices[role]} for the {role} engine")
            given = room * needs[role] / sum(needs[r] for r in unset)
        shares[role] = given
    for device in sorted(set(devices.values())):
        on_it = [r for r in roles if devices[r] == device]
        if len(on_it) > 1 and sum(shares[r] for r in on_it) > 1.0:
            split = " + ".join(f"{r}_gpu_memory={shares[r]:.2f}" for r in on_it)
            raise ValueError(f"{split} exceed GPU {device}'s memory, which the two engines share: together at most 1")
        for role in on_it:
            has, need = shares[role] * gpu_bytes[device], needs[role]
            if has < need:
                raise ValueError(
                    f"{role}_gpu_memory={shares[role]:.2f} of GPU {device} ({_gib(gpu_bytes[device])}) is "
                    f"{_gib(has)}; the {role} engine needs at least {_gib(need)} for its weights and KV cache "
                    "(raise the share, lower max_num_seqs or max_model_len, or place it on a GPU of its own)"
                )
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
            if role == Role.THETA and cfg.mode != "lockstep":
                raise ValueError(
                    f"{name}: in mode={cfg.mode!r} theta runs in the teacher's engine (use teacher_{name[6:]})"
                )
        kwargs: dict[str, Any] = role.pick(cfg.teacher_engine_kwargs, cfg.theta_engine_kwargs)
        if getattr(cfg, f"{role}_gpu_memory") is not None and "gpu_memory_utilization" in kwargs:
            raise ValueError(
                f"{role}_gpu_memory and {role}_engine_kwargs['gpu_memory_utilization'] both set the {role} engine's "
                "share of its GPU; set one"
            )
