"""Which rows the fused decision kernels take: one rule for the CPU's numba kernel and the GPU's Triton kernel.

Both kernels implement the same rows and alpha computers (``dual_sampling.decision.kernel`` derives the
algorithm); every other row goes to the torch reference in ``dual_sampling.decision.pipeline``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import torch

from alpha import AlphaComputer, FixedAlpha, KLSymmetryAlpha
from dual_sampling.decision.stages import STAGES

__all__ = ["KERNEL_ALPHA_METHODS", "KernelColumn", "kernel_device", "kernel_rows"]

KERNEL_ALPHA_METHODS = {FixedAlpha: 0, KLSymmetryAlpha: 1}
"""Alpha computer classes the kernels implement (exactly these classes, not subclasses), with their kernel code."""


class KernelColumn(IntEnum):
    """The columns of both kernels' output (``[b, 8]`` float64, one row per decided row). The kernels serve one
    teacher, so a row's records are the one-teacher roster's: α, the teacher's log π, θ's log π and log q."""

    TOKEN = 0
    ALPHA = 1
    LOGP_TEACHER = 2
    LOGP_STUDENT = 3
    LOGQ = 4
    STATUS = 5
    """0 decided; 1 handed to the reference (a non-finite entry, weights that underflow, an unconverged solve)."""
    PASSES = 6
    """α evaluations the row took."""
    UNCONVERGED = 7
    """1 where the α solve did not converge in the kernel's passes (such a row has status 1 too)."""


_UNFUSED = {device: tuple(stage for stage in STAGES if device not in stage.fused_on) for device in ("cpu", "cuda")}
"""Per kernel device, the stages its kernel does not implement: a row that uses one goes to the reference."""


def kernel_device(device: torch.device) -> str | None:
    """ "cpu" (numba), "cuda" (Triton, when it is installed) or None (the reference alone) for rows on ``device``."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return "cuda"
    return None


def kernel_rows(rows: Sequence, alpha_computer: AlphaComputer, device: torch.device) -> list[bool]:
    """Which rows a kernel decides: rows that use no stage the device's kernel lacks (``Stage.fused_on``: of today's
    stages, min_tokens' masking, the penalties and a group's diversity, on both) and record no top log-probabilities,
    with a kernel's alpha computer."""
    kind = kernel_device(device)
    if kind is None or type(alpha_computer) not in KERNEL_ALPHA_METHODS:
        return [False] * len(rows)
    return [r.top_logprobs == 0 and not any(stage.used(r) for stage in _UNFUSED[kind]) for r in rows]
