"""Mixture rollouts inside TRL's trainers: a stand-in for TRL's vLLM generation backend.

TRL 1.16 routes the generation of its on-policy trainers (GRPO, RLOO, DistillationTrainer, GOLD, IW-OPD, SDFT, SDPO)
through one object that each trainer builds in its constructor when ``use_vllm=True``:
``trl.generation.vllm_generation.VLLMGeneration``, with ``generate(prompts, images, num_generations, profiler)`` and
``sync_weights()``. :meth:`MixtureRollouts.trainer` builds a trainer whose generation object is a
:class:`MixtureGeneration` instead, with the same two methods, backed by an :class:`~dual_sampling.OptimalSamplingDual`
in any mode (in the speculative one, new θ reaches the teacher engine's draft model)::

    with MixtureRollouts(teacher="models/teacher", engine=EngineOptions(alpha_method="trust_region")) as rollouts:
        trainer = rollouts.trainer(GRPOTrainer, model="models/student", args=GRPOConfig(use_vllm=True), ...)
        trainer.train()

How the trainer gets it: while the trainer's constructor runs, the name ``VLLMGeneration`` in the modules the
trainer reads it from is bound to a factory for this trainer, and restored before :meth:`~MixtureRollouts.trainer`
returns. The trainer therefore runs its own ``use_vllm=True`` path, checks included, and the backend receives exactly
the sampling fields the trainer would have handed vLLM; those it cannot serve are refused there, by name.

What the trainer receives as log-probabilities: log q of each token, q being the law the token was drawn from
(q ∝ π_θ^(1−α)·π_t^α, after temperature and the top-k/top-p/min-p filters, as vLLM's ``processed_logprobs``).
GRPO's importance-sampling correction multiplies each token's loss by exp(log π_θ,T − log q) (π_θ,T: the trainer's
θ at the sampling temperature, before the update), which is then the mixture's importance weight π_θ/q: exact for
the mixture, where a student-only sampler's log-probabilities would make it wrong.

α is the teacher weight throughout.

The module is over 500 lines: it is one backend (its config, the engines' owner, and the generation object TRL calls,
with the batch grouping and the checks each batch needs). TRL's own seams live beside it
(:mod:`~dual_sampling.integrations.trl_rollout_func`, :mod:`~dual_sampling.integrations.trl_async`) and share its
engines' owner and its public helpers (:func:`sampling_options`, :func:`teacher_prompts`, :func:`check_room`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from dual_sampling.checks import need_int, need_number
from dual_sampling.driver.requests import generation_room, teacher_prompt_list
from dual_sampling.modes import mode_of, modes_with
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.records import DualGenerationOutput
from dual_sampling.roster import PAIR, Roster

__all__ = [
    "MixtureGeneration",
    "MixtureRollouts",
    "MixtureRolloutsConfig",
    "RolloutFailed",
    "check_room",
    "generation_teacher_prompts",
    "sampling_options",
    "teacher_prompts",
]


@dataclass
class MixtureRolloutsConfig:
    """What a :class:`MixtureRollouts` backend owns: the teacher, the engines and the checks. The student is the
    trainer's model; the sampling fields are the trainer's (see :class:`MixtureGeneration`)."""

    teacher: str | Mapping[str, str]
    """The teacher's local model folder; it must share the student's tokenizer. Or ``{name: folder}`` for several
    teachers (at least two; names are Python identifiers other than "theta"; the roster is θ, then these in order)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """How the two engines run: the α method and its settings (``alpha_method``, ``alpha_config``, bounds), dtype,
    sizes and placement. ``mode`` must stay ``"lockstep"``."""
    max_sampler_mismatch: float = 0.05
    """Largest |log π_θ(trainer) − log π_θ(record)| (nats) allowed on the sampled tokens of the first batch after each
    weight sync (the first with tokens: an empty batch leaves the check to the next); above it ``generate`` raises
    :class:`~dual_sampling.distill.mismatch.SamplerMismatchError`. The same threshold and advice as
    ``DistillConfig.max_sampler_mismatch`` (raise it to about 4 where either side runs bfloat16)."""
    mismatch_samples: int = 8
    """Rollouts of that first batch the check re-scores with the trainer's model (spread over the batch; all of a
    smaller batch). Each costs one forward of the trainer's model."""
    seed: int = 0
    """Seed of the first ``generate`` call; call k draws with seed + k, and each rollout's seed is derived from that
    and its position in the call."""
    teacher_prompt: Callable[[str], str | Sequence[int] | None] | Mapping[str, Callable] | None = None
    """Teacher hints: given the student's prompt as text (decoded from the trainer's token ids, special tokens
    kept), the teacher's prompt (text or token ids), or None for the same prompt; asked once per group of the
    trainer's repeated prompt (see :meth:`MixtureGeneration.generate`). Text is tokenized without adding special
    tokens (the decoded prompt kept its own). The longest prompt must leave ``max_completion_length`` tokens of the
    engines' ``max_model_len``. For datasets that carry a privileged field (a reference solution, feedback), as
    self-distillation setups do: look the row up and put its hint in the teacher's prompt. With several teachers,
    one function for every teacher or ``{teacher name: function}`` (a teacher not named sees the student's
    prompt)."""
    on_rollouts: Callable[[Any], None] | None = None
    """Called with each ``generate`` call's :class:`~dual_sampling.DualGenerationOutput` (every rollout's α,
    log π_t, log π_θ and log q per token, and its θ version), to keep or inspect the records: a request per group of
    the trainer's repeated prompt, whose samples, taken in order, are the trainer's rollouts in its order."""

    def __post_init__(self) -> None:
        if not mode_of(self.engine.mode).takes_new_theta:
            raise ValueError(
                f"engine.mode={self.engine.mode!r}: a trainer's rollouts need {modes_with('takes_new_theta')} (a mode "
                "whose θ takes new weights)"
            )
        if isinstance(self.teacher, Mapping):
            if len(self.teacher) < 2 or not all(isinstance(v, (str, os.PathLike)) for v in self.teacher.values()):
                raise ValueError(
                    f"teacher: a mapping names several teachers' folders (at least two), got {self.teacher}"
                )
        elif not isinstance(self.teacher, (str, os.PathLike)):
            raise ValueError(f"teacher: a model folder, or {{name: folder}} for several, got {self.teacher!r}")
        self.engine.check_roster(self.roster)
        hints = self.roster.per_teacher("teacher_prompt", self.teacher_prompt)
        for name, function in hints.items():
            if function is not None and not callable(function):
                shown = f"teacher_prompt[{name!r}]" if isinstance(self.teacher_prompt, Mapping) else "teacher_prompt"
                raise ValueError(f"{shown} must be callable, got {function!r}")
        need_number("max_sampler_mismatch", self.max_sampler_mismatch, finite=False)
        need_int("mismatch_samples", self.mismatch_samples, 1)
        need_int("seed", self.seed, 0)
        if self.on_rollouts is not None and not callable(self.on_rollouts):
            raise ValueError(f"on_rollouts must be callable, got {self.on_rollouts!r}")

    @property
    def roster(self) -> Roster:
        """The models by name: θ, then the teachers (in order); checked here (names that are no identifiers, or
        "theta", are refused naming ``teacher``)."""
        if not isinstance(self.teacher, Mapping):
            return PAIR
        try:
            return Roster.of_teachers(tuple(self.teacher))
        except ValueError as exc:
            raise ValueError(f"teacher: {exc}") from None

    @property
    def teacher_folders(self) -> tuple[str, ...]:
        """Every teacher's folder, in roster order."""
        return tuple(map(str, self.teacher.values())) if isinstance(self.teacher, Mapping) else (str(self.teacher),)


class RolloutFailed(RuntimeError):
    """A rollout ended with an error; the trainer cannot train on it, so the step stops instead of skipping it."""


class MixtureRollouts:
    """Mixture rollouts for TRL trainers: owns the teacher and the two engines, builds trainers that sample from q.

    ``MixtureRollouts(config)`` or ``MixtureRollouts(teacher=..., engine=EngineOptions(...), ...)`` (the fields of
    :class:`MixtureRolloutsConfig`). The engines start when the first trainer is built (the theta engine from the
    trainer's model folder) and stop at :meth:`close` or the end of the ``with`` block; trainers built in between
    share them (they must train the same student folder). Nothing runs at construction.
    """

    def __init__(self, config: MixtureRolloutsConfig | None = None, /, **settings: Any) -> None:
        if config is not None and settings:
            raise ValueError(f"pass a MixtureRolloutsConfig or its fields as keywords, not both ({sorted(settings)})")
        self.config = config if config is not None else MixtureRolloutsConfig(**settings)
        self._dual: Any = None
        self._student: str | None = None
        self._syncs = 0  # every trainer's syncs through these engines: one count, so no two share a label

    # ------------------------------------------------------------------ building trainers

    def trainer(self, trainer_class: type, /, **kwargs: Any) -> Any:
        """``trainer_class(**kwargs)`` (a TRL trainer whose config has ``use_vllm=True``), generating with
        mixture rollouts. Refusals (a field the mixture cannot serve, a config without ``use_vllm``) come before
        any engine starts, except those only the trainer can work out."""
        from trl.generation import vllm_generation

        args = kwargs.get("args")
        if args is None or not getattr(args, "use_vllm", False):
            raise ValueError(
                "args.use_vllm must be True: the trainer builds its generation backend only on its vLLM path, "
                "and that is the one mixture rollouts replace"
            )
        for name, reason in (
            ("tools", "multi-turn tool calls are not served by mixture rollouts"),
            ("environment_factory", "an environment's tool calls are not served by mixture rollouts"),
            ("rollout_func", "a custom rollout function generates by itself, so its rollouts would not come from q"),
        ):
            if kwargs.get(name):
                raise ValueError(f"{name}: {reason}")
        trainer = trainer_class.__new__(trainer_class)
        factory = lambda **fields: MixtureGeneration(self, trainer, **fields)
        with _generation_bound(trainer_class, vllm_generation, factory):
            trainer.__init__(**kwargs)
        if not isinstance(getattr(trainer, "vllm_generation", None), MixtureGeneration):
            raise TypeError(f"{trainer_class.__name__} did not build a generation backend through VLLMGeneration")
        if not isinstance(getattr(trainer, "_metrics", None), dict):
            raise TypeError(f"{trainer_class.__name__} has no _metrics: mixture statistics would have nowhere to go")
        return trainer

    # ------------------------------------------------------------------ the engines

    @property
    def dual(self) -> Any:
        """The running :class:`~dual_sampling.OptimalSamplingDual` (None before the first trainer and after close)."""
        return self._dual

    def update_alpha(self, method: str | None = None, **alpha_config: Any) -> tuple[str, dict[str, Any]]:
        """Decide with a new alpha computer from the next rollouts on (``OptimalSamplingDual.update_alpha``): for
        example a trust-region budget annealed through the trainer's steps from a callback."""
        if self._dual is None:
            raise RuntimeError("update_alpha: no engines run yet (build a trainer first)")
        return self._dual.update_alpha(method, **alpha_config)

    def _context(self, student: str) -> int:
        """Tokens per request (prompt and completion) the engines hold for ``student``: the running pair's, or the
        one they will start with (``context_length``, the pair's own), so a trainer is refused before they start."""
        if self._dual is not None:
            return self._dual.max_model_len
        from dual_sampling.options import context_length

        return context_length((*self.config.teacher_folders, student), self.config.engine.max_model_len)

    def start(self, student: str) -> Any:
        """The engines, started for ``student`` (a model folder) if none run; refused by name for another student."""
        if self._dual is None:
            from dual_sampling.api import OptimalSamplingDual

            self._dual = OptimalSamplingDual(self.config.teacher, student, engine=self.config.engine, use_tqdm=False)
            self._student = student
        elif student != self._student:
            raise ValueError(
                f"model={student!r}: these engines run the student {self._student!r}; build a MixtureRollouts per "
                "student"
            )
        return self._dual

    def next_sync(self, step: int) -> tuple[int, str]:
        """The next weight sync's number (1, 2, … counting the syncs of every trainer built here) and its theta
        version label ``sync-{number}-step-{step}`` (``step``: the syncing trainer's global step). A label names one
        set of weights: two trainers that each sync at step 0 get two labels."""
        self._syncs += 1
        return self._syncs, f"sync-{self._syncs}-step-{step}"

    def close(self) -> None:
        """Stop both engines and remove their shared memory (idempotent); a later trainer starts them again."""
        dual, self._dual, self._student = self._dual, None, None
        if dual is not None:
            dual.close()

    def __enter__(self) -> MixtureRollouts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _prompt_groups(prompts: list[list[int]], size: int) -> list[tuple[int, int]]:
    """(start, length) of each group of ``prompts``: runs of equal prompts, cut every ``size`` entries. TRL repeats
    each prompt ``num_generations`` times in a row, so these are its groups; two rows of one prompt drawn one after
    the other are two groups, as TRL counts them."""
    groups: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        if groups and groups[-1][1] < size and prompts[groups[-1][0]] == prompt:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((i, 1))
    return groups


@contextmanager
def _generation_bound(trainer_class: type, home: Any, factory: Callable[..., Any]) -> Iterator[None]:
    """``VLLMGeneration`` is ``factory`` in TRL's module and in every module of ``trainer_class``'s bases that imported
    it by name (GRPO and DistillationTrainer at import time; SDFT and SDPO read the module when they build it)."""
    original = home.VLLMGeneration
    modules = {home}
    for base in trainer_class.__mro__:
        module = sys.modules.get(base.__module__)
        if getattr(module, "VLLMGeneration", None) is original:
            modules.add(module)
    for module in modules:
        module.VLLMGeneration = factory
    try:
        yield
    finally:
        for module in modules:
            module.VLLMGeneration = original


# What the mixture does with each field TRL's trainers hand VLLMGeneration (tests/test_trl_backend.py checks that
# these tuples cover its signature exactly, so a field a new TRL adds is refused, never ignored). Sampling fields map
# to SamplingOptions; engine fields must ask for what the pair does, else they are refused with the reason.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "logprobs",
    "generation_kwargs",
)
"""Mapped to SamplingOptions (:func:`sampling_options`)."""
_ENGINE_FIELDS = {
    "mode": (
        "vllm_mode",
        ("colocate",),
        "the pair runs beside the trainer ('colocate'); a vLLM server samples one model",
    ),
    "structured_outputs_regex": ("vllm_structured_outputs_regex", (None,), "structured outputs are not served on q"),
    "tensor_parallel_size": ("vllm_tensor_parallel_size", (1,), "each engine runs on one device (EngineOptions)"),
    "enable_sleep_mode": ("vllm_enable_sleep_mode", (False,), "the pair keeps both engines and their KV caches awake"),
    "model_impl": ("vllm_model_impl", ("auto", "vllm"), "the engines load vLLM's own model implementation"),
    "trust_remote_code": ("trust_remote_code", (False,), "the engines load local folders with vLLM's own models"),
}
"""VLLMGeneration field → (the trainer config's field, the values served, why no other is)."""
_CAPACITY_HINTS = ("gpu_memory_utilization", "max_num_seqs")
"""Sizes the trainer picks for its own engine; the pair's are EngineOptions' (``*_gpu_memory``, ``max_num_seqs``)."""
_SERVER_ONLY = ("server_base_url", "server_host", "server_port", "server_timeout", "group_port")
"""Read only in mode='server', which is refused."""
_OTHER_FIELDS = ("processing_class", "max_model_length")
"""The trainer's tokenizer (the pair has its own) and its context, served when the engines hold it."""
TRL_FIELDS = frozenset((*_SAMPLING_FIELDS, *_ENGINE_FIELDS, *_CAPACITY_HINTS, *_SERVER_ONLY, *_OTHER_FIELDS))
"""Every keyword (besides model and accelerator) a trainer hands VLLMGeneration, each handled above."""
_TRAINER_SETS = ("max_tokens", "n", "best_of", "best_of_score")
"""SamplingOptions fields that the trainer's own settings decide (max_completion_length, num_generations)."""
_NOT_RETURNED = ("score", "top_logprobs", "dense_logprobs")
"""SamplingOptions fields whose results a rollout's record holds but TRL never receives: refused, as they would
only cost time (and a score that raises fails its rollout)."""


def sampling_options(fields: dict[str, Any]) -> tuple[SamplingOptions, int | None]:
    """The :class:`SamplingOptions` of a trainer's sampling ``fields`` (the keyword arguments TRL hands its vLLM
    backend: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_completion_length``,
    ``logprobs``, ``generation_kwargs``) as TRL applies them, and the seed ``generation_kwargs`` set (None: none);
    what q cannot serve is refused by name."""
    logprobs = fields.get("logprobs")
    if logprobs not in (None, 0):
        raise ValueError(
            f"logprobs={logprobs!r}: mixture rollouts return the sampled token's log q only (logprobs 0 or None)"
        )
    extra = dict(fields.get("generation_kwargs") or {})
    searched = sorted(set(extra) & {"use_beam_search", "length_penalty"})
    if searched:
        raise ValueError(
            f"generation_kwargs {searched}: rollouts must be samples of q, whose log q is their behaviour "
            "log-probability; a beam search returns no samples"
        )
    unseen = sorted(set(extra) & set(_NOT_RETURNED))
    if unseen:
        raise ValueError(
            f"generation_kwargs {unseen}: TRL receives each rollout's tokens and their log q only, so these "
            "would only cost time (and a score that raises would fail its rollout)"
        )
    allowed = {f.name for f in dataclasses.fields(SamplingOptions)} - {*_TRAINER_SETS, *_NOT_RETURNED}
    refused = sorted(set(extra) - allowed)
    if refused:
        raise ValueError(
            f"generation_kwargs {refused}: not served on q (the keys served are SamplingOptions fields: "
            f"{sorted(allowed)})"
        )
    seed = extra.pop("seed", None)
    if seed is not None:
        need_int("generation_kwargs['seed']", seed, 0)
    length = fields.get("max_completion_length", 16)
    if length is None:
        raise ValueError("max_completion_length=None: mixture rollouts need a token cap")
    # generation_kwargs override the named fields, as TRL's own backend applies them.
    named = {k: fields[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in fields}
    settings = {**named, **extra}
    top_p, top_k, min_p = settings.get("top_p"), settings.get("top_k"), settings.get("min_p")
    penalty = settings.get("repetition_penalty")
    settings.update(
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k in (None, 0) else top_k,
        min_p=0.0 if min_p is None else min_p,
        repetition_penalty=1.0 if penalty is None else penalty,
    )
    return SamplingOptions(max_tokens=length, **settings), seed


def teacher_prompts(rollouts: MixtureRollouts, tokenizer: Any, prompts: list[list[int]]) -> list[Any] | None:
    """Each prompt's teacher prompt (token ids) under ``rollouts``' :attr:`MixtureRolloutsConfig.teacher_prompt`, asked
    with the student's prompt decoded by ``tokenizer``; with several teachers, ``{teacher name: ids}`` per prompt (a
    teacher without a function of its own sees the student's prompt). None where no hint is configured."""
    hints = rollouts.config.teacher_prompt
    if hints is None:
        return None
    teachers = rollouts.config.roster.teachers
    functions = rollouts.config.roster.per_teacher("teacher_prompt", hints)
    out = []
    for prompt in prompts:
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        own = {}
        for name in teachers:
            chosen = functions[name](text) if functions.get(name) is not None else None
            if isinstance(chosen, str):
                # The decoded prompt kept its special tokens (a BOS, the chat template's): none is added again.
                chosen = tokenizer(chosen, add_special_tokens=False).input_ids
            own[name] = prompt if chosen is None else list(chosen)
        out.append(own if len(teachers) > 1 else own[teachers[0]])
    return out


def generation_teacher_prompts(teachers: list[Any] | None) -> Any:
    """The teacher prompts of some prompts (:func:`teacher_prompts`' entries) as ``generate`` takes them: a list, or
    with several teachers ``{teacher name: list}``."""
    if not teachers or not isinstance(teachers[0], Mapping):
        return teachers
    return {name: [own[name] for own in teachers] for name in teachers[0]}


def check_room(
    limit: int, wanted: int, prompts: list[list[int]], groups: list[tuple[int, int]], teachers: list | None
) -> None:
    """Refuse, naming the first, the groups of ``prompts`` ((start, size) each, ``teachers`` one per group) whose
    longest prompt leaves less than ``wanted`` tokens (max_completion_length) of the engines' ``limit``
    (max_model_len): such rollouts would stop early and the trainer would take them as truncated."""
    first, rollouts = None, 0  # the first group short of room (start, theta's prompt, the longest teacher's, room)
    for k, (start, size) in enumerate(groups):
        theta = prompts[start]
        teacher = theta if teachers is None else max(teacher_prompt_list(teachers[k]), key=len)
        room = generation_room(limit, teacher, theta)
        if room < wanted:
            rollouts += size
            first = first or (start, theta, teacher, room)
    if first is None:
        return
    start, theta, teacher, room = first
    side, length = (
        ("the teacher's hinted prompt", len(teacher)) if len(teacher) > len(theta) else ("theta's prompt", len(theta))
    )
    raise ValueError(
        f"prompt {start}: {side} has {length} tokens, which leaves {room} of max_model_len={limit} for its "
        f"completion, short of max_completion_length={wanted} ({rollouts} of {len(prompts)} "
        "rollouts of this batch are): they would stop early and the trainer would take them as truncated; drop "
        "or shorten such prompts (or hints), or raise EngineOptions.max_model_len"
    )


class MixtureGeneration:
    """The generation backend of one trainer, with ``VLLMGeneration``'s interface; built by the trainer itself
    (see :meth:`MixtureRollouts.trainer`), with VLLMGeneration's keyword arguments.

    TRL's sampling fields map to :class:`SamplingOptions` on q: temperature, top_p, top_k (0: off), min_p,
    repetition_penalty (on the mixture's logits), max_completion_length (``max_tokens``), and ``generation_kwargs``
    whose keys are SamplingOptions fields (they override the named ones, as in TRL's own backend; ``seed`` replaces
    :attr:`MixtureRolloutsConfig.seed`). ``vllm_max_model_length`` is served when the engines hold that context.
    Refused, naming the field: ``logprobs`` > 0 (only the sampled token's log q is returned), no token cap, a
    max_completion_length that no prompt leaves room for (at least the engines' ``max_model_len``), the
    ``generation_kwargs`` keys whose results TRL never receives (``_NOT_RETURNED``) or that are not SamplingOptions
    fields, and engine fields that ask for something the pair does not do (``_ENGINE_FIELDS``).
    """

    def __init__(self, rollouts: MixtureRollouts, trainer: Any, *, model: Any, accelerator: Any, **fields: Any) -> None:
        unknown = sorted(set(fields) - TRL_FIELDS)
        if unknown:
            raise TypeError(f"VLLMGeneration fields {unknown}: not known to mixture rollouts, so not served")
        for name, (config_field, served, reason) in _ENGINE_FIELDS.items():
            if name in fields and fields[name] not in served:
                raise ValueError(f"{config_field}={fields[name]!r}: not served by mixture rollouts: {reason}")
        trainer_context = fields.get("max_model_length")
        if trainer_context is not None:
            need_int("vllm_max_model_length", trainer_context, 1)
        if accelerator.num_processes != 1:
            raise ValueError(
                f"num_processes={accelerator.num_processes}: mixture rollouts serve one training process (the pair's "
                "two engines are one sampler; data-parallel ranks would each need their own)"
            )
        from accelerate.utils import is_peft_model

        if is_peft_model(model):
            raise ValueError("model: a PEFT model's adapters are not pushed to the theta engine; merge them first")
        self.sampling, seed = sampling_options(fields)
        context = rollouts._context(str(model.name_or_path))
        if trainer_context is not None and trainer_context > context:
            raise ValueError(
                f"vllm_max_model_length={trainer_context}: the mixture's engines hold {context} tokens per request; "
                "raise EngineOptions.max_model_len"
            )
        if self.sampling.max_tokens >= context:
            raise ValueError(
                f"max_completion_length={self.sampling.max_tokens}: the mixture's engines hold max_model_len={context} "
                "tokens per request, prompt included, so no prompt leaves room for it; lower it or raise "
                "EngineOptions.max_model_len"
            )
        self.model = model
        self._rollouts = rollouts
        self._trainer = trainer
        self._seeds = itertools.count(rollouts.config.seed if seed is None else seed)
        self._sync = 0  # the number of this trainer's latest sync (MixtureRollouts.next_sync); 0 before any
        self._check_next = True  # the engine loaded the folder; the trainer's model may already differ
        self.logprobs = fields.get("logprobs", 0)  # VLLMGeneration's default
        self.last_output: Any = None
        """The latest ``generate`` call's :class:`~dual_sampling.DualGenerationOutput` (its records, as
        :attr:`MixtureRolloutsConfig.on_rollouts` receives them)."""
        self.dual = rollouts.start(str(model.name_or_path))

    # ------------------------------------------------------------------ VLLMGeneration's interface

    @property
    def behaviour_version(self) -> str:
        """The theta version the next rollouts are drawn with (each record's ``theta_version``)."""
        return self.dual.weight_versions["theta"]

    def sync_weights(self) -> None:
        """Push the trainer's current weights into the theta engine under a new version label
        (:meth:`MixtureRollouts.next_sync`); the first batch with tokens after it is checked against the trainer's
        model (:attr:`MixtureRolloutsConfig.max_sampler_mismatch`)."""
        self._sync, version = self._rollouts.next_sync(self._trainer.state.global_step)
        state = {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        self.dual.update_theta(state, version=version)
        self._check_next = True

    def generate(
        self,
        prompts: list[list[int]],
        images: list[Any] | None,
        num_generations: int,
        profiler: Any = None,
    ) -> tuple[list[list[int]], list[list[int]], list | None, list | None]:
        """One rollout per entry of ``prompts`` (token ids), in their order. The trainer hands each prompt
        ``num_generations`` times in a row (TRL's ``RepeatSampler``; its colocate mode samples each copy alone): each
        run of equal prompts, cut every ``num_generations`` entries as TRL groups them, is drawn as one request of n
        samples, so ``diversity_penalty`` acts across the group, and its samples fill the run's places. Returns
        (prompt_ids, completion_ids, logprobs, logprob_token_ids): logprobs ``[B][T][1]`` is each token's log q,
        logprob_token_ids ``[B][T][1]`` the token; both None where the trainer asked for no log-probabilities
        (``logprobs=None``).

        A prompt whose longer side (theta's prompt or the teacher's hinted one) leaves less than
        ``max_completion_length`` of the engines' ``max_model_len`` fails the call by name (ValueError) before any
        rollout is drawn. Failing, not a metric and a warning: its rollouts would stop where the context ends, and the
        trainer, unable to tell them from rollouts cut at ``max_completion_length``, would train on them as truncated
        (with ``mask_truncated_completions``, with zero loss), so long prompts would quietly weigh less; as with a
        failed rollout (:class:`RolloutFailed`), the step stops rather than train on them unmarked. Drop or shorten
        such prompts (or hints), or raise ``EngineOptions.max_model_len``."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("images: mixture rollouts serve text prompts only")
        need_int("num_generations", num_generations, 1)
        prompts = [list(map(int, p)) for p in prompts]
        groups = _prompt_groups(prompts, num_generations)
        firsts = [prompts[start] for start, _ in groups]
        teachers = teacher_prompts(self._rollouts, self.dual.tokenizer, firsts)
        check_room(self.dual.max_model_len, self.sampling.max_tokens, prompts, groups, teachers)
        seed = next(self._seeds)
        requests: list[Any] = [None] * len(groups)
        with profiler or nullcontext():
            # One call per group size (one call for TRL's batches, whose groups all hold num_generations); the
            # rollout at start + j is seeded from (seed, start, j), whichever call draws it.
            for size in sorted({size for _, size in groups}, reverse=True):
                chosen = [k for k, (_, n) in enumerate(groups) if n == size]
                out = self.dual.generate(
                    [firsts[k] for k in chosen],
                    None if teachers is None else generation_teacher_prompts([teachers[k] for k in chosen]),
                    sampling=dataclasses.replace(self.sampling, seed=seed, n=size),
                    prompt_keys=[str(groups[k][0]) for k in chosen],
                    use_tqdm=False,
                )
                for k, request in zip(chosen, out.requests, strict=True):
                    requests[k] = dataclasses.replace(request, index=k)
        samples = [s for request in requests for s in request.samples]
        failed = [(i, s.error) for i, s in enumerate(samples) if s.error is not None]
        if failed:
            first, error = failed[0]
            raise RolloutFailed(f"{len(failed)} of {len(samples)} rollouts failed; rollout {first}: {error}")
        mismatch = self._check(requests) if self._check_next else None
        self._log(samples, mismatch)
        self.last_output = out = DualGenerationOutput(requests)
        if self._rollouts.config.on_rollouts is not None:
            self._rollouts.config.on_rollouts(out)
        prompt_ids = [list(request.theta_prompt_token_ids) for request in requests for _ in request.samples]
        completion_ids = [list(s.token_ids) for s in samples]
        if self.logprobs is None:
            return prompt_ids, completion_ids, None, None
        logprobs = [[[float(lq)] for lq in s.logq] for s in samples]
        token_ids = [[[int(t)] for t in s.token_ids] for s in samples]
        return prompt_ids, completion_ids, logprobs, token_ids

    # ------------------------------------------------------------------ helpers

    def _check(self, requests: list[Any]) -> Any:
        from dual_sampling.distill.mismatch import SamplerMismatchError, sampler_trainer_mismatch

        cfg = self._rollouts.config
        # mismatch_samples rollouts, not requests: a group's request holds num_generations of them.
        rollouts = [dataclasses.replace(request, samples=[s]) for request in requests for s in request.samples]
        step = max(1, len(rollouts) // cfg.mismatch_samples)
        chosen = rollouts[::step][: cfg.mismatch_samples]
        mismatch = sampler_trainer_mismatch(self.model, chosen, vocab=self.dual.vocab)
        if not mismatch.tokens:
            return None  # nothing to compare (an empty batch): the check waits for the next batch that has tokens
        if not mismatch.max_abs <= cfg.max_sampler_mismatch:
            raise SamplerMismatchError(
                f"theta version {self.behaviour_version!r}: the rollouts' log π_θ differ from the trainer's model by "
                f"up to {mismatch.max_abs:.3g} nats (mean {mismatch.mean_abs:.3g} over {mismatch.tokens} tokens), "
                f"above max_sampler_mismatch={cfg.max_sampler_mismatch:g}: the theta engine did not sample from the "
                "model being trained (a sync that did not reach it?)",
                mismatch,
            )
        self._check_next = False
        return mismatch

    def _log(self, samples: list[Any], mismatch: Any) -> None:
        """Per-rollout α statistics, log π_θ − log q per token and the behaviour version into the trainer's metrics
        (averaged over a logging interval, shown with its own)."""
        mode = "train" if self._trainer.model.training else "eval"
        metrics = self._trainer._metrics[mode]
        per_rollout = [statistics.fmean(alpha) for alpha in (s.total_alpha for s in samples) if alpha]
        if per_rollout:  # with several teachers, of their total weight Σα, and each teacher's mean beside
            metrics["mixture/alpha_mean"].append(statistics.fmean(per_rollout))
            metrics["mixture/alpha_min"].append(min(per_rollout))
            metrics["mixture/alpha_max"].append(max(per_rollout))
            columns = self._rollouts.config.roster.alpha_columns
            for column in columns if len(columns) > 1 else ():
                values = [a for s in samples for a in s.roster_columns[column]]
                metrics[f"mixture/{column}_mean"].append(statistics.fmean(values))
        gaps = [t - q for s in samples for t, q in zip(s.logp_theta, s.logq)]
        if gaps:
            metrics["mixture/log_theta_minus_log_q"].append(statistics.fmean(gaps))
        metrics["mixture/behaviour_version"].append(float(self._sync))
        if mismatch is not None:
            metrics["mixture/sampler_mismatch_max"].append(mismatch.max_abs)
