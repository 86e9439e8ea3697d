"""The ways a dual engine draws from q, as data: what each mode can do, and where its driver is built.

A mode is a :class:`Mode` in :data:`MODES`, registered by :func:`register_mode`. Code that serves a feature in some
modes only asks the mode for the capability (``mode_of(cfg.mode).takes_new_theta``), never for its name, and the
refusal names the modes that have it. ``start`` names the function that builds the mode's driver, resolved only when
an engine starts (this module imports nothing of the driver's, so the settings in ``options`` can check a mode).

- ``lockstep``: a teacher engine and a theta engine, each with its own prompt, in lockstep.
- ``speculative``: one engine, the teacher's, with theta as vLLM's draft model (docs/speculative.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MODES", "Mode", "mode_of", "modes_with", "register_mode"]


@dataclass(frozen=True)
class Mode:
    """One way of drawing from q, and what it serves."""

    name: str
    """The value of :attr:`~dual_sampling.options.EngineOptions.mode` that picks it."""
    start: str
    """``"module:function"`` building the driver: called with the engine's ``DualEngineConfig``, its tokenizer, the
    engine's context length in positions and the driver's settings (whose ``max_model_len`` is a request's room: the
    engine's context less what the mode keeps free)."""
    theta_engine: bool
    """Theta runs in an engine of its own (its own settings and placement); False: it is the teacher engine's draft
    model, which must have as many embedding rows as its target and keeps 2γ positions of the context free."""
    takes_new_theta: bool
    """``update_theta`` reaches the θ that draws, so on-policy rounds (``distill``, the TRL backend) can run on it."""
    beam_search: bool
    """Serves beam search on q (``beam_search``, ``use_beam_search``)."""
    dense_logprobs: bool = True
    """Records each model's top k per token (``dense_logprobs``), which distillation's top-k losses read."""
    holds_requests: bool = True
    """``pause(mode="keep")`` holds the requests in flight across a θ update (each token records its θ version)."""

    def build_driver(self, *args: Any, **kwargs: Any) -> Any:
        """The driver of an engine in this mode (``start`` resolved and called with these arguments)."""
        module, function = self.start.split(":")
        build: Callable[..., Any] = getattr(importlib.import_module(module), function)
        return build(*args, **kwargs)


MODES: dict[str, Mode] = {}
"""Every registered mode by name, in registration order."""


def register_mode(mode: Mode) -> Mode:
    """Add ``mode`` to :data:`MODES`; a second mode of the same name raises."""
    if mode.name in MODES:
        raise ValueError(f"a mode named {mode.name!r} is registered already")
    MODES[mode.name] = mode
    return mode


def mode_of(name: str) -> Mode:
    """The registered mode ``name``; ValueError naming the field ``mode`` for any other value."""
    if not isinstance(name, str) or name not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {name!r}")
    return MODES[name]


def modes_with(capability: str) -> str:
    """The modes that have ``capability`` (a boolean field of :class:`Mode`), as a refusal names them:
    ``mode='lockstep'`` or ``mode='a' or mode='b'``."""
    return " or ".join(f"mode={m.name!r}" for m in MODES.values() if getattr(m, capability))


register_mode(
    Mode(
        "lockstep",
        "dual_sampling.driver.pair:start_lockstep",
        theta_engine=True,
        takes_new_theta=True,
        beam_search=True,
    )
)
register_mode(
    Mode(
        "speculative",
        "dual_sampling.driver.speculative_driver:start_speculative",
        theta_engine=False,
        takes_new_theta=True,
        beam_search=False,
        dense_logprobs=False,
        holds_requests=False,
    )
)
