"""The stages between log q and the draw (steps 4–10 of :mod:`dual_sampling.decision.pipeline`): one module each in
this package, found here and run in their :attr:`~dual_sampling.decision.stages.base.Stage.order`.

Each stage declares the per-row settings it reads (a dataclass, every field with its docstring), checks their values
where a request is made (``Stage.check``, called by ``SamplingOptions``: one home for each rule, every error naming
its field), says whether a row uses it and whether the fused kernels implement it (``Stage.fused_on``;
``fusable.kernel_rows`` derives its rule from these), and applies itself to a batch's log q ``[b, V]`` in place. The
order is vLLM's v1 sampler's for the stages both have (min_tokens and logit_bias, then the penalties, then
temperature, then min-p, top-k and top-p), after the teacher-support constraint, which only a mixture has, and before
the diversity of a group's samples, which acts on the law each would draw from.

**A new stage is one new module here** (its settings dataclass and its ``Stage`` subclass): :data:`STAGES` finds it,
:class:`DecisionOptions` gains its settings, and from them ``SamplingOptions``, ``RowSampling``, the CLI's flags, the
run configs and the speculative mode's refusal. A stage no kernel implements sends its rows to the torch reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from dual_sampling.decision.stages.base import CoreSettings, Stage, StageBatch, keep_top_k_top_p
from dual_sampling.decision.stages.logit_bias import LOGIT_BIAS_LIMIT, clamped_logit_bias
from dual_sampling.decision.stages.penalties import MAX_PENALTY, penalised_logits, penalised_tokens
from dual_sampling.decision.stages.temperature import MAX_TEMPERATURE, MIN_TEMPERATURE

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_PENALTY",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "STAGES",
    "DecisionOptions",
    "Stage",
    "StageBatch",
    "clamped_logit_bias",
    "keep_top_k_top_p",
    "needs_logit_offset",
    "needs_prompt",
    "penalised_logits",
    "penalised_tokens",
]


def _found_stages() -> tuple[Stage, ...]:
    """One instance of every ``Stage`` subclass defined in this package's modules, by ascending ``order``."""
    found: dict[type, None] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            defined_here = isinstance(value, type) and value.__module__ == module.__name__
            if defined_here and issubclass(value, Stage) and value is not Stage:
                found[value] = None
    stages = sorted(found, key=lambda cls: cls.order)
    orders = [cls.order for cls in stages]
    if len(set(orders)) != len(orders):
        raise TypeError(f"two stages share an order: {[(cls.__name__, cls.order) for cls in stages]}")
    return tuple(cls() for cls in stages)


STAGES: tuple[Stage, ...] = _found_stages()
"""The stages in the order they run."""


def _composed_options() -> type:
    """:class:`CoreSettings` and every stage's settings as one kw-only dataclass, fields in stage order."""
    names = [f.name for cls in (*(s.settings for s in STAGES), CoreSettings) for f in dataclasses.fields(cls)]
    if len(set(names)) != len(names):
        raise TypeError(f"two stages declare one setting: {sorted({n for n in names if names.count(n) > 1})}")
    # A dataclass gathers its bases' fields from the last base to the first: bases in reverse give the stage order.
    bases = (CoreSettings, *reversed([s.settings for s in STAGES]))
    cls = type("DecisionOptions", bases, {"__module__": __name__, "__doc__": _OPTIONS_DOC})
    return dataclasses.dataclass(kw_only=True)(cls)


_OPTIONS_DOC = """The settings of each token's decision from q ∝ π_θ^(1−α)·π_t^α (α is the teacher weight):
    every stage's settings (each declared, with its docstring, in the stage's module) and :class:`CoreSettings`
    (the first-token rule and what is recorded besides the token). ``SamplingOptions`` (a request's options) and
    ``RowSampling`` (what the teacher engine receives per sample) both extend it, so neither copies it."""

DecisionOptions = _composed_options()


def needs_prompt(row: object) -> bool:
    """Whether a stage ``row`` uses reads its prompt's token ids (theta's travel with the row only then)."""
    return any(stage.needs_prompt(row) for stage in STAGES)


def needs_logit_offset(row: object) -> bool:
    """Whether a stage ``row`` uses reads the mixture's raw logits (theta then publishes its log-normaliser)."""
    return any(stage.needs_logit_offset(row) for stage in STAGES)
