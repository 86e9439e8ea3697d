"""Configuration: how to sample (:class:`SamplingOptions`) and how to run the engines (:class:`EngineOptions`).

Each is one validated dataclass with a docstring under every field; errors name the
field. :class:`DualEngineConfig` adds the two model folders to the engine options, and
the data-generation run's ``RunConfig`` composes both, so no field is written twice.
:meth:`DualEngineConfig.model_engines` says which folder and which per-engine settings belong to which model of the
roster (:class:`ModelEngine`), one teacher or several.

The module is over 500 lines because it is the one home of the settings a run takes, each field with its docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpha import AlphaComputer, get_alpha_computer
from dual_sampling import modes
from dual_sampling.beams import MAX_BEAM_WIDTH, BeamSearchOptions
from dual_sampling.checks import MAX_COUNT, is_count, is_int, is_number, need_int, require
from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.decision.stages import LOGIT_BIAS_LIMIT, STAGES, DecisionOptions, needs_prompt
from dual_sampling.lockstep import TOP_LOGPROBS_MAX
from dual_sampling.lockstep.row_channel import ROW_TRANSPORTS
from dual_sampling.records import BEST_OF_SCORES, USER_SCORE, ScoreFunction, score_function
from dual_sampling.roster import PAIR, THETA, Roster

__all__ = [
    "BEST_OF_SCORES",
    "LOGIT_BIAS_LIMIT",
    "MAX_COUNT",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "RUNTIME_ONLY",
    "UNSUPPORTED_SAMPLING",
    "DualEngineConfig",
    "EngineOptions",
    "ModelEngine",
    "SamplingOptions",
    "context_length",
    "default_kv_cache_bytes",
    "derive_seed",
    "kv_cache_bytes_needed",
    "model_config",
]

SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds are 64-bit signed integers, as in vLLM's request models."""
MAX_STOP_STRINGS = 16
"""Stop strings per request at most: the leader engine checks each on every step."""
MAX_STOP_STRING_CHARS = 256
"""Characters per stop string at most."""
UNSUPPORTED_SAMPLING = ("bad_words",)
"""vLLM options that would act after the token is forced; refused by name."""
BEAM_SEARCH = {"beam_search": True}
"""Field metadata of a sampling setting that a beam search reads (:attr:`SamplingOptions.use_beam_search`); every
other setting must keep its default there."""
RUNTIME_ONLY = {"changes_records": False}
"""Field metadata of a setting that changes how samples are drawn (speed, memory, progress, where), never which:
a data run leaves it out of its identity, so ``--resume`` may change it."""


def derive_seed(seed: int, prompt_key: int | str, sample_index: int) -> int:
    """A distinct, reproducible 63-bit seed per sample of a prompt: sample ``sample_index`` of the prompt keyed
    ``prompt_key`` in a call seeded ``seed`` (:attr:`SamplingOptions.seed`)."""
    digest = hashlib.blake2b(f"{seed}/{prompt_key}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _is_text(value: Any) -> bool:
    """A str that UTF-8 can encode (JSON may carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingOptions(DecisionOptions):
    """How to sample from q ∝ π_θ^(1−α)·π_t^α. Every filter acts on q; α is the teacher weight. The per-token
    settings are :class:`~dual_sampling.decision.stages.DecisionOptions`' (each checked by the stage that applies
    it); these are the request's."""

    max_tokens: int = field(default=256, metadata=BEAM_SEARCH)
    """Generated tokens per sample at most (also capped by the room the longer prompt leaves in max_model_len)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (at most 16, of at most 256 characters): a sample ends at the token that completes one; its
    text ends before it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample, besides both models' EOS ids."""
    n: int = field(default=1, metadata=BEAM_SEARCH)
    """Samples per prompt."""
    best_of: int | None = None
    """Draw this many samples per prompt (>= n) and keep the n with the highest best_of_score."""
    best_of_score: str = "logq"
    """Score for best_of: logq, logp_theta or logp_teacher summed over the sample's tokens, or with _mean (logq_mean,
    ...) averaged per token, which does not favour short samples. A user ``score`` replaces it."""
    score: str | ScoreFunction | None = field(default=None, metadata=BEAM_SEARCH)
    """A user score of each complete sample, recorded with its name (SampleRecord.score): a callable f(prompt,
    sample) -> float (prompt: as passed to generate), or "module:function" naming one; best_of keeps the n highest.
    A function that raises, or returns no finite number, fails that sample as score_error."""
    seed: int = field(default=0, metadata=BEAM_SEARCH)
    """Seed of the call; sample j of prompt i is drawn with a seed derived from (seed, prompt key, j)."""
    use_beam_search: bool = field(default=False, metadata=BEAM_SEARCH)
    """Return each prompt's n best beams over q (beam width n, at most 10) instead of n samples, searched as vLLM's
    beam search searches but ranked by cum log q / length^length_penalty with the length as ``length_penalty`` says
    (not vLLM's); a search is deterministic, so every setting but n, max_tokens, seed, score and length_penalty keeps
    its default."""
    length_penalty: float = field(default=1.0, metadata=BEAM_SEARCH)
    """With use_beam_search: the final ranking's exponent of the length, the generated tokens without a final EOS
    (1: mean log q per generated token; 0: the sum). Unlike vLLM's, the prompt's tokens are not counted."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, kind in (("stop", list), ("stop_token_ids", list), ("logit_bias", dict)):
            value = getattr(self, name) or kind()
            allowed = (list, tuple) if kind is list else dict
            require(isinstance(value, allowed), f"{name} must be a {kind.__name__}, got {value!r}")
            setattr(self, name, kind(value))
        # JSON and YAML give token ids as strings; they are token ids all the same.
        self.logit_bias = {
            int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v for k, v in self.logit_bias.items()
        }
        for f in dataclasses.fields(self):  # a float setting given as an integer (1 for 1.0)
            if f.type == "float" and is_int(getattr(self, f.name)):
                setattr(self, f.name, float(getattr(self, f.name)))
        require(
            is_count(self.max_tokens, 1),
            f"max_tokens must be an integer >= 1 (at most {MAX_COUNT}), got {self.max_tokens!r}",
        )
        for stage in STAGES:  # after max_tokens: min_tokens is checked against it
            stage.check(self)
        require(
            isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_STRINGS,
            f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
        )
        require(
            all(_is_text(s) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            f"stop must hold non-empty strings of at most {MAX_STOP_STRING_CHARS} characters (valid Unicode), "
            f"got {[s[:40] if isinstance(s, str) else s for s in self.stop]!r}",
        )
        require(
            all(is_count(t, 0) for t in self.stop_token_ids),
            f"stop_token_ids must be token ids in [0, {MAX_COUNT}], got {self.stop_token_ids[:5]!r}",
        )
        require(is_count(self.n, 1), f"n must be an integer >= 1 (at most {MAX_COUNT}), got {self.n!r}")
        require(
            self.best_of is None or (is_count(self.best_of, 1) and self.best_of >= self.n),
            f"best_of must be an integer >= n={self.n}, got {self.best_of!r}",
        )
        require(
            self.best_of_score in BEST_OF_SCORES,
            f"best_of_score must be one of {BEST_OF_SCORES}, got {self.best_of_score!r}",
        )
        if self.score is not None:
            score_function(self.score)  # importable and callable, or a ValueError naming score
        require(
            isinstance(self.force_first_token, bool),
            f"force_first_token must be true or false, got {self.force_first_token!r}",
        )
        require(
            is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
            f"seed must be a 64-bit signed integer, got {self.seed!r}",
        )
        need_int("top_logprobs", self.top_logprobs, 0, most=TOP_LOGPROBS_MAX)
        require(
            is_int(self.dense_logprobs) and self.dense_logprobs >= 0,
            f"dense_logprobs must be a non-negative integer, got {self.dense_logprobs!r}",
        )
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        """use_beam_search and length_penalty: the width is n, and a setting a search does not use is refused by
        name rather than ignored."""
        require(
            isinstance(self.use_beam_search, bool),
            f"use_beam_search must be true or false, got {self.use_beam_search!r}",
        )
        require(is_number(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not self.use_beam_search:
            require(self.length_penalty == 1.0, "length_penalty acts on beam search only (use_beam_search)")
            return
        require(self.n <= MAX_BEAM_WIDTH, f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search")
        plain = SamplingOptions(max_tokens=self.max_tokens)
        for f in dataclasses.fields(SamplingOptions):
            if not f.metadata.get("beam_search") and getattr(self, f.name) != getattr(plain, f.name):
                raise ValueError(f"{f.name} is not used by beam search (use_beam_search); leave it out")

    def beam_search(self) -> BeamSearchOptions:
        """The search these options ask for (:attr:`use_beam_search`): n beams of at most max_tokens tokens."""
        require(self.use_beam_search, "use_beam_search is not set")
        return BeamSearchOptions(beam_width=self.n, max_tokens=self.max_tokens, length_penalty=self.length_penalty)

    def row(
        self,
        seed: int,
        masked_before_min_tokens: Sequence[int] = (),
        prompt_token_ids: Sequence[int] = (),
        group: int = 0,
        member: int = 0,
        group_size: int = 1,
    ) -> RowSampling:
        """The engine-side settings of one sample: the one mapping from these options.

        The :class:`DecisionOptions` fields are these options'; ``seed`` is the sample's own (given here) and
        ``stop_token_ids``: the tokens masked while fewer than
        ``min_tokens`` were generated, ``masked_before_min_tokens`` (the EOS ids) and
        :attr:`stop_token_ids` together. ``prompt_token_ids`` (theta's prompt) travel only where a stage reads
        them (the repetition penalty); ``group``, ``member`` and ``group_size`` place a sample in its diverse group
        (diversity_penalty).
        """
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecisionOptions)}
        stops = tuple(sorted(set(masked_before_min_tokens) | set(self.stop_token_ids)))
        prompt = tuple(prompt_token_ids) if needs_prompt(self) else ()
        return RowSampling(
            seed=seed,
            stop_token_ids=stops,
            prompt_token_ids=prompt,
            group=group,
            member=member if group else 0,  # a place in a group only where there is one
            group_size=group_size if group else 1,
            **shared,
        )

    @property
    def ranked_by(self) -> str:
        """What best_of ranks by: the user score (``USER_SCORE``) where one is given, else best_of_score."""
        return USER_SCORE if self.score is not None else self.best_of_score

    @property
    def draws(self) -> int:
        """Samples drawn per prompt (best_of if set, else n)."""
        return self.best_of or self.n

    def check_vocab(self, vocab: int, eos_token_ids: Sequence[int] = ()) -> None:
        """Refuse token ids outside the shared vocabulary, more dense log-probabilities than it has tokens, and stop
        ids that leave no token to generate.

        With every token a stop token, a row that fails has no token left to be forced with (the engines' last
        resort), so such a request is refused here, naming the field.
        """
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            bad = [t for t in ids if t >= vocab]
            require(not bad, f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        require(
            self.dense_logprobs <= vocab,
            f"dense_logprobs={self.dense_logprobs} exceeds the vocabulary of {vocab} tokens",
        )
        require(
            len(set(self.stop_token_ids) | set(eos_token_ids)) < vocab,
            f"stop_token_ids and the EOS ids cover the whole vocabulary of {vocab} tokens: none is left to generate",
        )


@dataclass(kw_only=True, frozen=True)
class EngineOptions:
    """How the two engines run: everything of a dual engine but its two models. Validated at construction, and frozen
    so that what was checked is what runs (``dataclasses.replace`` makes a changed copy, checked again)."""

    alpha_method: str = "kl_symmetry"
    """Registered alpha method: fixed, kl_symmetry, ess_balance, trust_region, entropy, or a plugin's."""
    alpha_min: float = 0.0
    """Lower clamp on the teacher weight α."""
    alpha_max: float = 1.0
    """Upper clamp on the teacher weight α."""
    alpha_config: dict[str, Any] = field(default_factory=dict)
    """Further fields of the alpha method (for example ``{"alpha": 0.3}`` for fixed)."""
    sync_timeout: float = field(default=60.0, metadata=RUNTIME_ONLY)
    """Seconds an engine waits for its partner before failing the requests it waits on."""
    max_num_seqs: int = field(default=8, metadata=RUNTIME_ONLY)
    """Requests each engine runs at once (equal on both sides)."""
    max_model_len: int | None = None
    """Prompt plus generated tokens per request; None: min(model limit, 2048)."""
    max_num_batched_tokens: int | None = field(default=None, metadata=RUNTIME_ONLY)
    """Tokens per engine step (prefills included); None: max(max_model_len, 2048). At least max_model_len."""
    dtype: str = "float32"
    """Model dtype; float32 is about 2x faster than bfloat16 on CPUs without bf16."""
    kv_cache_memory_bytes: int | None = field(default=None, metadata=RUNTIME_ONLY)
    """KV cache per engine; None sizes it for max_num_seqs full contexts, so nothing is ever preempted."""
    enforce_eager: bool = field(default=True, metadata=RUNTIME_ONLY)
    """Skip graph compilation (engine start in seconds rather than minutes)."""
    enable_prefix_caching: bool = field(default=True, metadata=RUNTIME_ONLY)
    """Share the KV of common prompt prefixes (the n samples of one prompt)."""
    cpu_binding: str = field(default="split", metadata=RUNTIME_ONLY)
    """CPU backend only. "split": each engine's model gets its own half of the CPUs, so both run at once;
    "vllm": vLLM's own binding (both models on the same cores)."""
    teacher_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM engine arguments for the teacher; settings that would break lockstep are refused after start. With
    several teachers (``DualEngineConfig.model_teacher`` a mapping), a dict of them per teacher name."""
    theta_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM engine arguments for theta."""
    row_transport: str = field(default="auto", metadata=RUNTIME_ONLY)
    """How theta's rows reach the teacher's decision (``lockstep.row_channel``): "host" (shared memory, the CPU's),
    "pinned" (that memory page-locked for the GPUs), "device" (a buffer on the teacher's GPU, shared by CUDA IPC),
    or "auto": device, then pinned, then host, whichever these engines can use. Refused by name at start if not."""
    teacher_device: int | Mapping[str, int] | None = field(default=None, metadata=RUNTIME_ONLY)
    """CUDA only: the GPU the teacher engine runs on, by this process's numbering (a CUDA_VISIBLE_DEVICES of this
    process applies first); None: the first. Its processes see that GPU alone (driver/placement.py). With several
    teachers, one GPU for every teacher's engine or ``{teacher name: GPU}`` (a teacher not named: the first)."""
    theta_device: int | None = field(default=None, metadata=RUNTIME_ONLY)
    """CUDA only: the GPU the theta engine runs on, as teacher_device; the same GPU as the teacher's or another."""
    teacher_gpu_memory: float | Mapping[str, float] | None = field(default=None, metadata=RUNTIME_ONLY)
    """CUDA only: the share of its GPU's memory the teacher engine must find free when it starts, in (0, 1) (vLLM's
    gpu_memory_utilization). The pair fixes each engine's KV cache, so vLLM sizes nothing from it: it gates the start.
    None: the engine's need (weights and KV cache) over its GPU's memory. A layout that cannot start is refused
    before any engine does (driver/placement.py). With several teachers, one share for each teacher's engine or
    ``{teacher name: share}``."""
    theta_gpu_memory: float | None = field(default=None, metadata=RUNTIME_ONLY)
    """CUDA only: the theta engine's share, as teacher_gpu_memory."""
    max_dense_logprobs: int = field(default=0, metadata=RUNTIME_ONLY)
    """The largest ``dense_logprobs`` a request may ask for. Shared memory holds 24·k bytes per token of every slot's
    context (ids, own and other log-probabilities of both models' top k; k = 64: 1.5 KiB per token, 3 MiB per slot at
    2,048 tokens); 0 refuses dense log-probabilities."""
    use_tqdm: bool = field(default=True, metadata=RUNTIME_ONLY)
    """Show a progress bar over samples in generate()."""
    mode: str = "lockstep"
    """How tokens are drawn from q. "lockstep": a teacher engine and a theta engine decide every token together.
    "speculative": one engine runs the teacher with theta as its draft model; theta drafts ``num_speculative_tokens``
    tokens, one teacher forward checks them against q, and every token still follows q exactly (docs/theory.md,
    "Speculative mixture sampling"). Its limits: both models see the same prompt (no teacher prompts), only plain
    sampling is served (temperature 1; no top-k, top-p, min-p, logit bias, min_tokens, teacher support, top or dense
    log-probabilities), and theta's weights cannot be updated in place."""
    num_speculative_tokens: int = 4
    """γ, theta's drafts per teacher forward (``mode="speculative"`` only)."""

    @property
    def alpha_kwargs(self) -> dict[str, Any]:
        """The alpha computer's keyword arguments: ``alpha_min``, ``alpha_max`` and :attr:`alpha_config`, assembled here
        once for the engines, the validation and the records."""
        return {"alpha_min": self.alpha_min, "alpha_max": self.alpha_max, **self.alpha_config}

    def check_roster(self, roster: Roster) -> None:
        """ValueError naming the setting that does not fit the models of ``roster``: an α computer that cannot weight
        its teachers (a fixed α must list one weight per teacher, a method must have a form for several); a
        per-teacher placement that names no teacher of the roster (or is given per name to one teacher); with
        several teachers, ``teacher_engine_kwargs`` not keyed by teacher name, and the speculative mode. Run configs
        call it before anything starts or is written."""
        self._checked_alpha.check_teacher_count(len(roster.teachers))
        names = roster.teachers
        for name in ("teacher_device", "teacher_gpu_memory"):
            roster.per_teacher(name, getattr(self, name))  # a mapping names teachers, and several of them
        if len(names) == 1:
            return
        kwargs = self.teacher_engine_kwargs
        require(
            isinstance(kwargs, Mapping)
            and set(kwargs) <= set(names)
            and all(isinstance(v, Mapping) for v in kwargs.values()),
            f"teacher_engine_kwargs: with several teachers, a dict of vLLM engine arguments per teacher name "
            f"({', '.join(names)}), got {kwargs!r}",
        )
        require(
            modes.mode_of(self.mode).theta_engine,
            f"mode={self.mode!r} runs one teacher (theta is its draft model); several teachers need mode='lockstep'",
        )

    def alpha_computer(self) -> AlphaComputer:
        """A fresh α computer of :attr:`alpha_method` with :attr:`alpha_kwargs`."""
        return get_alpha_computer(self.alpha_method, **self.alpha_kwargs)

    def __post_init__(self) -> None:
        for name in ("alpha_min", "alpha_max", "sync_timeout"):  # 30 and 30.0 configure (and hash) the same run
            if is_int(getattr(self, name)):
                object.__setattr__(self, name, float(getattr(self, name)))
        # Building the computer validates the method name and its bounds, naming the bad value. Whether it weights
        # the run's teachers is checked where the models are known (DualEngineConfig, a run's config), with this
        # computer: the options are checked once.
        object.__setattr__(self, "_checked_alpha", self.alpha_computer())
        require(
            is_number(self.sync_timeout) and self.sync_timeout > 0,
            f"sync_timeout must be a positive number of seconds, got {self.sync_timeout!r}",
        )
        require(
            is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
            f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}",
        )
        require(
            self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2),
            f"max_model_len must be an integer >= 2, got {self.max_model_len!r}",
        )
        require(
            self.max_num_batched_tokens is None
            or (is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1),
            f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}",
        )
        require(
            self.kv_cache_memory_bytes is None
            or (is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes > 0),
            f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}",
        )
        require(
            is_int(self.max_dense_logprobs) and self.max_dense_logprobs >= 0,
            f"max_dense_logprobs must be a non-negative integer, got {self.max_dense_logprobs!r}",
        )
        require(
            self.cpu_binding in ("split", "vllm"), f"cpu_binding must be 'split' or 'vllm', got {self.cpu_binding!r}"
        )
        require(
            self.row_transport in ROW_TRANSPORTS,
            f"row_transport must be one of {ROW_TRANSPORTS}, got {self.row_transport!r}",
        )
        for name in ("teacher_device", "theta_device"):
            for label, value in _each_value(name, getattr(self, name), per_teacher=name.startswith("teacher")):
                require(
                    value is None or (is_int(value) and value >= 0), f"{label} must be a GPU index >= 0, got {value!r}"
                )
        for name in ("teacher_gpu_memory", "theta_gpu_memory"):
            for label, value in _each_value(name, getattr(self, name), per_teacher=name.startswith("teacher")):
                require(
                    value is None or (is_number(value) and 0 < value < 1),
                    f"{label} must be a share of the GPU's memory in (0, 1), got {value!r}",
                )
        for name in ("teacher_engine_kwargs", "theta_engine_kwargs"):
            require(isinstance(getattr(self, name), dict), f"{name} must be a dict of vLLM engine arguments")
        mode = modes.mode_of(self.mode)
        need_int("num_speculative_tokens", self.num_speculative_tokens, 1, most=32)
        require(
            mode.theta_engine or not self.theta_engine_kwargs,
            f"theta_engine_kwargs: in mode={self.mode!r} theta runs in the teacher's engine (use "
            "teacher_engine_kwargs)",
        )


@dataclass(frozen=True)
class ModelEngine:
    """One model of a run and the settings of the engine that runs it (:meth:`DualEngineConfig.model_engines`)."""

    name: str
    """The model's name in the roster (``teacher`` and ``theta`` in a pair)."""
    folder: str
    """Its local Hugging Face folder."""
    engine_kwargs: Mapping[str, Any]
    """Extra vLLM engine arguments of its engine."""
    device: int | None = None
    """CUDA only: its GPU (``teacher_device``/``theta_device``, a teacher's entry with several); None: the first."""
    gpu_memory: float | None = None
    """CUDA only: the share of its GPU it must find free at start (``teacher_gpu_memory``/``theta_gpu_memory``)."""


@dataclass(frozen=True)
class DualEngineConfig(EngineOptions):
    """Everything fixed for the life of a dual engine: its models and the :class:`EngineOptions`."""

    model_teacher: str | Mapping[str, str]
    """Path of the teacher model (a local Hugging Face folder); or, for several teachers, ``{name: folder}`` of at
    least two, each name a Python identifier other than "theta": they name the records' columns (``alpha_<name>``,
    ``logp_<name>``), and the roster is θ, then the teachers in this order (θ's engine leads)."""
    model_theta: str
    """Path of the theta (student) model; must share the teacher's tokenizer."""

    def __post_init__(self) -> None:
        self._check_models()
        super().__post_init__()
        self.check_roster(self.roster)

    def _check_models(self) -> None:
        teachers = self.model_teacher
        if isinstance(teachers, Mapping):
            require(
                len(teachers) >= 2,
                f"model_teacher: a mapping names several teachers (at least two), got {dict(teachers)!r}; pass one "
                "teacher's folder as a string",
            )
            Roster((*teachers, THETA))  # names: identifiers, unique, none "theta"; errors name them
            teachers = {name: _model_folder(f"model_teacher[{name!r}]", path) for name, path in teachers.items()}
            object.__setattr__(self, "model_teacher", teachers)
        else:
            object.__setattr__(self, "model_teacher", _model_folder("model_teacher", teachers))
        object.__setattr__(self, "model_theta", _model_folder("model_theta", self.model_theta))

    @property
    def roster(self) -> Roster:
        """The run's models by name, the leading engine's first: :data:`~dual_sampling.roster.PAIR` for one teacher,
        else θ, then the teachers in the order given (:meth:`~dual_sampling.roster.Roster.of_teachers`)."""
        return Roster.of_teachers(tuple(self.model_teacher) if isinstance(self.model_teacher, Mapping) else None)

    @property
    def teacher_count(self) -> int:
        return len(self.roster.teachers)

    def model_engines(self) -> tuple[ModelEngine, ...]:
        """Each model of the :attr:`roster` with its engine's settings, in roster order: the one home of which folder
        and which per-engine setting belong to which model."""
        if isinstance(self.model_teacher, Mapping):
            devices = self.roster.per_teacher("teacher_device", self.teacher_device)
            shares = self.roster.per_teacher("teacher_gpu_memory", self.teacher_gpu_memory)
            teachers = tuple(
                ModelEngine(name, folder, dict(self.teacher_engine_kwargs.get(name, {})), devices[name], shares[name])
                for name, folder in self.model_teacher.items()
            )
        else:
            teachers = (
                ModelEngine(
                    PAIR.teachers[0],
                    self.model_teacher,
                    self.teacher_engine_kwargs,
                    self.teacher_device,
                    self.teacher_gpu_memory,
                ),
            )
        theta = ModelEngine(THETA, self.model_theta, self.theta_engine_kwargs, self.theta_device, self.theta_gpu_memory)
        by_name = {model.name: model for model in (*teachers, theta)}
        return tuple(by_name[name] for name in self.roster.names)

    def model_engine(self, name: str) -> ModelEngine:
        """The model named ``name`` (:meth:`model_engines`); ValueError naming the roster otherwise."""
        return self.model_engines()[self.roster.position(str(name))]

    @property
    def folders(self) -> tuple[str, ...]:
        """Every model's folder, in roster order."""
        return tuple(model.folder for model in self.model_engines())

    @property
    def tokenizer_folder(self) -> str:
        """The folder whose tokenizer every engine and the front door use: the first teacher's."""
        return self.model_engine(self.roster.teachers[0]).folder

    @classmethod
    def of(
        cls,
        model_teacher: str | Mapping[str, str],
        model_theta: str,
        options: EngineOptions,
        use_tqdm: bool | None = None,
    ) -> DualEngineConfig:
        """The models with ``options`` as they were built: checked then (the options are frozen), not again, but for
        the teacher count of several teachers. Each field's value is a copy, so a change inside one (a dict's entry)
        is not this config's. ``use_tqdm`` replaces the progress bar's setting."""
        if not isinstance(options, EngineOptions):
            raise TypeError(f"engine must be an EngineOptions, got {type(options).__name__}")
        config = cls.__new__(cls)
        values = {f.name: copy.deepcopy(getattr(options, f.name)) for f in dataclasses.fields(EngineOptions)}
        if use_tqdm is not None:
            require(isinstance(use_tqdm, bool), f"use_tqdm must be True or False, got {use_tqdm!r}")
            values["use_tqdm"] = use_tqdm
        for name, value in {**values, "model_teacher": model_teacher, "model_theta": model_theta}.items():
            object.__setattr__(config, name, value)
        config._check_models()
        object.__setattr__(config, "_checked_alpha", options._checked_alpha)
        config.check_roster(config.roster)  # the options knew no models
        return config


def _each_value(name: str, value: Any, per_teacher: bool) -> list[tuple[str, Any]]:
    """The values of setting ``name`` to check, each with the name an error gives it: the one value, or with a
    per-teacher setting given as ``{teacher: value}`` each entry (``name['math']``)."""
    if per_teacher and isinstance(value, Mapping):
        return [(f"{name}[{teacher!r}]", v) for teacher, v in value.items()]
    return [(name, value)]


def model_setting(roster: Roster, name: str, setting: str) -> str:
    """The setting of model ``name``'s engine called ``setting`` (``device``, ``gpu_memory``, ``engine_kwargs``) as the
    user gave it, for messages: ``<name>_<setting>`` in a pair and for θ, one teacher's entry of
    ``teacher_<setting>`` with several."""
    if roster == PAIR or name == THETA:
        return f"{name}_{setting}"
    return f"teacher_{setting}[{name!r}]"


def _model_folder(name: str, path: object) -> str:
    """``path`` as a local model folder's path; FileNotFoundError naming ``name`` if it holds no config.json."""
    folder = Path(str(path))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{name}={str(folder)!r} is not a local model folder (no config.json)")
    return str(folder)


def model_config(path: str) -> dict:
    """A model folder's config.json."""
    return json.loads((Path(path) / "config.json").read_text())


def context_length(folders: Sequence[str], max_model_len: int | None) -> int:
    """Tokens per request (prompt and generation): ``max_model_len``, or min(every model's limit, 2048)."""
    limit = min(model_config(m).get("max_position_embeddings", 2048) for m in folders)
    chosen = max_model_len or min(limit, 2048)
    if chosen > limit:
        raise ValueError(f"max_model_len={chosen} exceeds the models' limit of {limit} positions")
    return chosen


ENGINE_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
"""Bytes per element of each engine dtype name (the KV cache's and, in driver/placement.py, the weights')."""


def kv_cache_bytes_needed(
    model_path: str, max_num_seqs: int, max_model_len: int, dtype: str = "float32", block_size: int = 1
) -> int:
    """Bytes of KV cache that hold ``max_num_seqs`` full contexts, each in whole blocks, plus vLLM's null block."""
    cfg = model_config(model_path)
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * ENGINE_DTYPE_BYTES.get(dtype, 4)
    blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    return blocks * block_size * per_token


def default_kv_cache_bytes(
    model_path: str, max_num_seqs: int, max_model_len: int, dtype: str = "float32", block_size: int = 128
) -> int:
    """The cache an engine gets when none is given: the need at vLLM's CPU block size, plus 10 %."""
    return int(kv_cache_bytes_needed(model_path, max_num_seqs, max_model_len, dtype, block_size) * 1.1)
