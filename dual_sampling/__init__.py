"""dual-sampling: generate text from the geometric mixture of a teacher and a theta (student) model.

    from dual_sampling import OptimalSamplingDual
    with OptimalSamplingDual(model_teacher, model_theta, alpha_method="kl_symmetry") as s:
        out = s.generate(prompts, max_tokens=256)

The public names load on first use, so an engine process that imports the shared-memory
protocol (``dual_sampling.lockstep``) never imports the driver, and vLLM is imported only
when an engine starts. ``start_engine_server_early()`` (a program's first lines, before it
imports vLLM) starts the engines' fork server at once, so that its imports run beside the
program's own.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DualEngineConfig",
    "DualGenerationOutput",
    "EngineOptions",
    "EnginePairDead",
    "ModelsAndPrompts",
    "OptimalSamplingDual",
    "RequestFailed",
    "RequestRecord",
    "SampleRecord",
    "SamplingOptions",
    "SyncError",
    "start_engine_server_early",
]

_HOME = {
    "DualEngineConfig": "dual_sampling.options",
    "EngineOptions": "dual_sampling.options",
    "SamplingOptions": "dual_sampling.options",
    "ModelsAndPrompts": "dual_sampling.run_settings",
    "DualGenerationOutput": "dual_sampling.records",
    "RequestRecord": "dual_sampling.records",
    "SampleRecord": "dual_sampling.records",
    "OptimalSamplingDual": "dual_sampling.api",
    "SyncError": "dual_sampling.lockstep",
    "RequestFailed": "dual_sampling.lockstep",
    "EnginePairDead": "dual_sampling.lockstep",
    "start_engine_server_early": "dual_sampling.driver.engine_start:start_early",
}
"""Where each public name lives: ``module`` (the same name there) or ``module:name``."""


def __getattr__(name: str) -> Any:
    if name in _HOME:
        module, _, attribute = _HOME[name].partition(":")
        return getattr(importlib.import_module(module), attribute or name)
    raise AttributeError(f"module 'dual_sampling' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
