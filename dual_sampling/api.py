"""OptimalSamplingDual: generate from q ∝ π_θ^(1−α)·π_t^α with a teacher and a theta engine in lockstep.

A thin layer over :class:`dual_sampling.driver.lockstep_driver.LockstepDriver`: it checks the two
models against each other, derives the limits (context length, EOS ids), tokenizes
prompts, turns :class:`SamplingOptions` into one request per sample, and assembles
:class:`DualGenerationOutput`. Everything about running the engines lives below it.

It is the one door for front ends: the server and the distillation loop prepare prompts, pause
and resume, relabel and read weight versions, and read health and statistics through it, never
through the driver.

One module over 500 lines: it is that one door (sampling, beam search, streaming, weights, state), and a second
module would give front ends two.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from alpha import get_alpha_computer
from dual_sampling.beams import (
    BeamSearchOptions,
    BeamSequence,
    Candidates,
    beam_samples,
    decision_candidates,
    run_beam_search,
)
from dual_sampling.checks import require
from dual_sampling.decision.pipeline import RowSampling, check_stages_for_teachers
from dual_sampling.driver.loop_thread import as_coroutine
from dual_sampling.driver.requests import (
    DualRequest,
    PromptPair,
    check_teacher_set,
    prompt_pairs,
    request_columns,
)
from dual_sampling.driver.speculative_engine import check_draft_model
from dual_sampling.driver.versions import check_update
from dual_sampling.driver.weight_loads import Load, prepared_update
from dual_sampling.driver.weight_sync import WeightSync
from dual_sampling.driver.weights import WeightsCheck
from dual_sampling.lockstep import SyncError
from dual_sampling.modes import mode_of, modes_with
from dual_sampling.options import (
    UNSUPPORTED_SAMPLING,
    DualEngineConfig,
    EngineOptions,
    SamplingOptions,
    context_length,
    derive_seed,
    model_config,
)
from dual_sampling.records import DualGenerationOutput, RequestRecord, SampleDelta, SampleRecord, best_of, scored
from dual_sampling.roster import PAIR, THETA, Role
from dual_sampling.text import engine_tokenizer, sample_text
from dual_sampling.vocab import check_embedding_rows, check_tokenizers_match, embedding_rows, eos_token_ids

__all__ = ["OptimalSamplingDual", "context_length", "derive_seed"]

T = TypeVar("T")


async def _all_or_none(coroutines: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; one error ends the call, and the others are cancelled (their requests aborted on both
    engines) before it is raised, never left running."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        # gather has cancelled every task once; a second cancel would cut short a task's wait for its requests'
        # release (the driver's stream ends only once both engines let its request go).
        raise
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)


TeacherPrompt = str | Sequence[int] | Mapping[str, str | Sequence[int]]
"""The teacher's prompt (text or token ids); or a mapping from a teacher's name to its own, the form several teachers
need (a teacher it does not name sees theta's)."""


def _copied(teacher_ids: list[int] | Mapping[str, list[int]]) -> list[int] | dict[str, list[int]]:
    """A copy of a teacher prompt's ids: the one teacher's, or each of several teachers' by name."""
    if isinstance(teacher_ids, Mapping):
        return {name: list(ids) for name, ids in teacher_ids.items()}
    return list(teacher_ids)


class OptimalSamplingDual:
    """Generate from q ∝ π_θ^(1−α)·π_t^α with a teacher and a theta engine in lockstep.

    Use as a context manager (or call :meth:`close`) so the engines stop and the shared
    memory is removed. The engines' settings are ``engine`` (an :class:`EngineOptions`, checked when it was built,
    as the front ends hand theirs on) or ``settings``, the fields of :class:`DualEngineConfig`; with ``engine``, only
    ``use_tqdm`` may be given besides.
    """

    def __init__(
        self,
        model_teacher: str | Mapping[str, str],
        model_theta: str,
        engine: EngineOptions | None = None,
        **settings: Any,
    ) -> None:
        teacher = model_teacher if isinstance(model_teacher, Mapping) else str(model_teacher)
        if engine is None:
            cfg = DualEngineConfig(teacher, str(model_theta), **settings)
        else:
            extra = sorted(set(settings) - {"use_tqdm"})
            if extra:
                raise TypeError(f"OptimalSamplingDual takes engine= or the options' fields, not both; got {extra}")
            cfg = DualEngineConfig.of(teacher, str(model_theta), engine, settings.get("use_tqdm"))
        self.config = cfg
        self.roster = cfg.roster
        """The models by name, the leading engine's first (:data:`~dual_sampling.roster.PAIR` for one teacher)."""
        self.tokenizer = engine_tokenizer(cfg.tokenizer_folder)
        """The first teacher's tokenizer, the object vLLM's engines use (read-only; a subclass vLLM names
        ``Cached...``: to save a tokenizer, load the folder's own)."""
        for folder in cfg.folders:
            if folder != cfg.tokenizer_folder:
                check_tokenizers_match(self.tokenizer, engine_tokenizer(folder))
        self.vocab = len(self.tokenizer)
        th_cfg = model_config(cfg.model_theta)
        for model in (m for m in cfg.model_engines() if m.name != THETA):  # each teacher against θ
            teacher_rows = embedding_rows(model_config(model.folder))
            check_embedding_rows(teacher_rows, embedding_rows(th_cfg), self.vocab, cfg.mode)
        self.max_model_len = context_length(cfg.folders, cfg.max_model_len)
        """Prompt plus generated tokens a request may use: in speculative mode, the engine's context less 2γ positions.
        vLLM drafts for a batch only while its longest sequence has γ positions to spare beyond a round's γ drafts
        (else no request in it gets θ rows), so every request keeps 2γ free."""
        engine_len = self.max_model_len
        self.mode = mode_of(cfg.mode)
        if not self.mode.theta_engine:  # theta is the teacher engine's draft model
            check_draft_model(th_cfg)
            self.max_model_len -= 2 * cfg.num_speculative_tokens
            if self.max_model_len < 2:
                raise ValueError(
                    f"num_speculative_tokens={cfg.num_speculative_tokens}: mode={cfg.mode!r} keeps 2γ of "
                    f"max_model_len={engine_len} free, which leaves no room for a request"
                )
        self.eos_token_ids = eos_token_ids(cfg.folders, self.tokenizer)
        self._weights_checks: dict[Role, WeightsCheck] = {}
        self._weight_syncs: dict[Role, WeightSync] = {}
        _exit_on_sigterm()
        driver_settings = dict(
            vocab=self.vocab,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            sync_timeout=cfg.sync_timeout,
            max_dense_logprobs=cfg.max_dense_logprobs,
        )
        self.driver = self.mode.build_driver(cfg, self.tokenizer, engine_len, **driver_settings)

    # ------------------------------------------------------------------ blocking API

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        teacher_prompts: Sequence[str | Sequence[int]] | Mapping[str, Sequence[str | Sequence[int]]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        n: int | None = None,
        seed: int | None = None,
        *,
        sampling: SamplingOptions | None = None,
        prompt_keys: Sequence[str] | None = None,
        use_tqdm: bool | None = None,
        teachers: Sequence[str] | None = None,
        **options: Any,
    ) -> DualGenerationOutput:
        """Generate ``n`` samples per prompt. Prompts are text or token ids.

        ``teacher_prompts`` (same length) lets the teacher see a different prompt from theta's,
        for example with a reference solution as a hint; or a mapping from a teacher's name to its prompts (the
        form several teachers need; a teacher it does not name sees theta's). Sampling is set either by keywords
        (the fields of :class:`SamplingOptions`, with its defaults: max_tokens=256,
        temperature=1.0, top_p=1.0, top_k=-1, n=1, seed=0, ...) or by one ``sampling`` object. Sample j of
        prompt i is drawn with a seed derived from (seed, i, j); ``prompt_keys`` (stable ids,
        one per prompt) replace i, so a sample's seed does not depend on which other prompts
        share the call (data-generation runs rely on this to resume). A sample that fails has
        ``finish_reason="error"`` and an ``error``; the call itself raises only for bad
        arguments or a dead engine.

        ``teachers`` (several teachers only): the teachers this call's samples mix, by name; the others weigh 0, and
        their engines do no work for these requests (θ's engine leads, so it runs every one). Each sample names them
        (``SampleRecord.teachers``), and a teacher left out has no ``logp_<teacher>`` column. None: every teacher.
        """
        self._check_open()
        named = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n, seed=seed)
        options.update({k: v for k, v in named.items() if v is not None})
        if sampling is not None and options:
            raise ValueError(f"pass sampling options either as sampling= or as keywords, not both ({sorted(options)})")
        opts = sampling or self._options(**options)
        pairs = prompt_pairs(self.tokenizer, self.vocab, self.max_model_len, prompts, teacher_prompts, self.roster)
        if prompt_keys is not None and len(prompt_keys) != len(prompts):
            raise ValueError(f"prompt_keys has {len(prompt_keys)} entries but prompts has {len(prompts)}")
        keys = list(prompt_keys) if prompt_keys is not None else list(range(len(prompts)))
        seeds = [[derive_seed(opts.seed, keys[i], j) for j in range(opts.draws)] for i in range(len(pairs))]
        if opts.use_beam_search:
            require(teachers is None, "teachers: beam search runs every teacher")
            per_prompt = self.driver.call(self._search_all(pairs, opts, seeds))
        else:
            requests = [
                [self.request(pair, opts, seeds[i][j], group, j, teachers) for j in range(opts.draws)]
                for i, pair in enumerate(pairs)
                # A diverse group's id pairs its samples in the teacher's processor only: any unique number will do.
                for group in [secrets.randbits(62) + 1 if opts.diversity_penalty > 0 else 0]
            ]
            show = self.config.use_tqdm if use_tqdm is None else use_tqdm
            it = iter(self.driver.call(self._sample_all([r for per in requests for r in per], show)))
            per_prompt = [[next(it) for _ in range(opts.draws)] for _ in pairs]
        out = []
        for i, (pair, mine) in enumerate(zip(pairs, per_prompt)):
            if opts.score is not None:
                mine = [scored(sample, prompts[i], opts.score) for sample in mine]
            if opts.best_of:
                mine = [mine[k] for k in best_of(mine, opts.n, opts.ranked_by)]
            out.append(RequestRecord(i, _copied(pair.teacher_ids), list(pair.theta_ids), mine))
        return DualGenerationOutput(out)

    def beam_search(
        self,
        prompts: Sequence[str | Sequence[int]],
        teacher_prompts: Sequence[str | Sequence[int]] | Mapping[str, Sequence[str | Sequence[int]]] | None = None,
        *,
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
    ) -> list[list[BeamSequence]]:
        """Beam search over q in the shape of vLLM's ``LLM.beam_search`` (``dual_sampling.beams``): per prompt, its best
        ``beam_width`` beams by cum log q / length^length_penalty, each token with its α, log π_t, log π_θ and log q.
        The length counts the beam's generated tokens without a final EOS; vLLM's also counts the prompt's, so the
        two rankings can differ wherever length_penalty is not 0."""
        self._check_open()
        self._require_beam_search("beam_search")
        options = BeamSearchOptions(
            beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
        )
        pairs = prompt_pairs(self.tokenizer, self.vocab, self.max_model_len, prompts, teacher_prompts)
        room = min(p.room for p in pairs)
        require(max_tokens <= room, f"max_tokens={max_tokens} does not fit: a prompt leaves {room} tokens")
        row = self._beam_step_row(options)

        def step(prefixes: list[tuple[list[int], list[int]]]) -> list[Candidates]:
            requests = [DualRequest(teacher, theta, row, 1) for teacher, theta in prefixes]
            return self.driver.call(decision_candidates(self.driver.stream, requests))

        out = run_beam_search([(p.teacher_ids, p.theta_ids) for p in pairs], options, self.eos_token_ids, step)
        for beam in (beam for beams in out for beam in beams):
            beam.text = sample_text(self.tokenizer, beam.tokens, stop_token=beam.finish_reason == "stop")
        return out

    async def beam_search_samples(
        self, pair: PromptPair, opts: SamplingOptions, seeds: Sequence[int]
    ) -> list[SampleRecord]:
        """The beam search ``opts`` asks for (``use_beam_search``) on one prepared prompt pair, from any asyncio loop:
        its n best beams as samples, best first, labelled with ``seeds``; at most the pair's room of tokens each. A
        search that fails fails its own beams only (``dual_sampling.beams.beam_samples``)."""
        self._require_beam_search("use_beam_search")
        options = dataclasses.replace(opts.beam_search(), max_tokens=min(opts.max_tokens, pair.room))
        row = self._beam_step_row(options)
        search = beam_samples(
            self.driver.stream,
            lambda teacher, theta: DualRequest(teacher, theta, row, 1),
            (list(pair.teacher_ids), list(pair.theta_ids)),
            options,
            self.eos_token_ids,
            self.tokenizer,
            seeds,
        )
        return await self.driver.thread.run(search)

    def _beam_step_row(self, options: BeamSearchOptions) -> RowSampling:
        """A search step's one-token decision: q's 2·beam_width most likely tokens reported (the candidates)."""
        step = SamplingOptions(max_tokens=1, temperature=0.0, top_logprobs=2 * options.beam_width)
        return step.row(0, self.eos_token_ids)

    def _require_beam_search(self, what: str) -> None:
        require(self.mode.beam_search, f"{what} is served in {modes_with('beam_search')} only")
        require(len(self.roster.teachers) == 1, f"{what} with several teachers is not built yet")

    async def _search_all(
        self, pairs: Sequence[PromptPair], opts: SamplingOptions, seeds: Sequence[Sequence[int]]
    ) -> list[list[SampleRecord]]:
        return await _all_or_none([self.beam_search_samples(p, opts, s) for p, s in zip(pairs, seeds)])

    async def _sample_all(self, requests: list[DualRequest], show: bool) -> list[SampleRecord]:
        from tqdm.auto import tqdm

        with tqdm(total=len(requests), desc="dual sampling", unit="seq", disable=not show) as bar:

            async def one(request: DualRequest) -> SampleRecord:
                sample = await self.driver.sample(request)
                bar.update(1)
                return sample

            return await _all_or_none([one(r) for r in requests])

    # ------------------------------------------------------------------ new weights

    def update_theta(
        self, weights: Mapping[str, Any] | str | Path, *, version: str | None = None, mode: str = "wait"
    ) -> str:
        """Give the theta engine new weights without a restart; returns their version label.

        ``weights`` is a state dict (tensor name → tensor, e.g. ``model.state_dict()`` of the
        transformers model) or a folder of safetensors files. It is checked against the
        checkpoint the engine started from before anything changes: a missing, extra, wrongly
        shaped or non-finite tensor is refused with a ValueError naming it, and the engines
        serve on unchanged. ``mode`` says what happens to the requests in flight: ``"wait"``
        lets them finish on the old weights, ``"abort"`` ends them (``finish_reason="abort"``,
        ``stop_reason="weight_update"``). Either way no sample mixes two versions; every sample
        drawn after this returns comes from the new weights and records ``version`` (default:
        the count of theta's updates) as its ``theta_version``. Thread-safe.
        """
        return self._update("theta", weights, version, mode)

    def update_teacher(
        self, weights: Mapping[str, Any] | str | Path, *, version: str | None = None, mode: str = "wait"
    ) -> str:
        """The same as :meth:`update_theta`, for the teacher (self-distillation, EMA teachers)."""
        return self._update("teacher", weights, version, mode)

    async def update_theta_async(
        self,
        weights: Mapping[str, Any] | str | Path,
        *,
        version: str | None = None,
        mode: str = "wait",
        follow_symlinks: bool = True,
    ) -> str:
        """:meth:`update_theta` from any asyncio loop (the checks and the staging run in a thread).

        ``follow_symlinks=False`` refuses a folder whose files are symlinks (the server passes it for folders its
        clients name: a link in an allowed folder could point anywhere); a Hugging Face cache snapshot is links.
        """
        return await asyncio.to_thread(self._update, "theta", weights, version, mode, follow_symlinks)

    async def update_teacher_async(
        self, weights: Mapping[str, Any] | str | Path, *, version: str | None = None, mode: str = "wait"
    ) -> str:
        """:meth:`update_teacher` from any asyncio loop."""
        return await asyncio.to_thread(self._update, "teacher", weights, version, mode)

    @property
    def max_dense_logprobs(self) -> int:
        """The largest ``dense_logprobs`` a request may ask for (the engine option of that name)."""
        return self.config.max_dense_logprobs

    @property
    def weight_versions(self) -> dict[str, str]:
        """The version of each engine's weights now: {"teacher": ..., "theta": ...} ("0" as started)."""
        return self.driver.versions.snapshot()

    def set_weight_version(self, role: str, version: str) -> None:
        """Label ``role``'s current weights ``version`` without changing them (samples launched from now carry it).

        A label the role's weights carried before is refused with a ValueError. Thread-safe.
        """
        self._check_open()
        self._require_versioned(Role.parse(role))
        self.driver.call(as_coroutine(self.driver.versions.relabel, role, version))

    async def set_weight_version_async(self, role: str, version: str) -> None:
        """:meth:`set_weight_version` from any asyncio loop."""
        self._check_open()
        self._require_versioned(Role.parse(role))
        await self.driver.thread.run(as_coroutine(self.driver.versions.relabel, role, version))

    def pause(self, mode: str = "wait") -> None:
        """Start no new sample until :meth:`resume`; returns once no request runs on either engine.

        The requests in flight finish (``mode="wait"``), are aborted (``mode="abort"``, their samples say
        ``stop_reason="weight_update"``) or are held where they are (``mode="keep"``, vLLM's name; not in the
        speculative mode); requests that arrive meanwhile wait. Held requests go on after :meth:`resume` under the
        weights θ has then: a θ update taken meanwhile loads at once, and each such sample names the θ version of
        every token (``theta_versions``; its records are exact token by token, since every held request recomputes
        its KV cache under the new weights). While requests are held, a teacher update, an update with ``mode="abort"``
        and a new alpha computer are refused by name, and an abort of a held request takes effect at the resume.
        Thread-safe.
        """
        self._check_pause(mode)
        self.driver.call(self.driver.pause(mode))

    async def pause_async(self, mode: str = "wait") -> None:
        """:meth:`pause` from any asyncio loop."""
        self._check_pause(mode)
        await self.driver.thread.run(self.driver.pause(mode))

    def resume(self) -> None:
        """Start samples again after :meth:`pause` (held requests first). Thread-safe."""
        self._check_open()
        self.driver.call(self.driver.resume())

    async def resume_async(self) -> None:
        """:meth:`resume` from any asyncio loop."""
        self._check_open()
        await self.driver.thread.run(self.driver.resume())

    def _check_pause(self, mode: str) -> None:
        self._check_open()
        if mode == "keep":
            require(self.mode.holds_requests, f"mode='keep' is served in {modes_with('holds_requests')} only")

    def update_alpha(self, method: str | None = None, **alpha_config: Any) -> tuple[str, dict[str, Any]]:
        """Decide with a new alpha computer from now on: ``method`` (None: the current one) with ``alpha_config``,
        whose bounds default to the engine's ``alpha_min`` and ``alpha_max``. Checked here first (a bad name or value
        is refused by name, and nothing changes); it takes effect once no request runs (those in flight finish on the
        old one, those waiting start on the new one). Returns :attr:`alpha_settings`. Thread-safe.

        A distillation run anneals a ``trust_region`` budget this way between rounds.
        """
        self._check_open()
        current, _ = self.alpha_settings
        method = current if method is None else method
        config = {"alpha_min": self.config.alpha_min, "alpha_max": self.config.alpha_max, **alpha_config}
        get_alpha_computer(method, **config).check_teacher_count(self.config.teacher_count)
        self.driver.call(self.driver.update_alpha(method, config))
        return self.alpha_settings

    @property
    def alpha_settings(self) -> tuple[str, dict[str, Any]]:
        """The alpha method and its full configuration (bounds included) the teacher decides with now."""
        if self.driver.alpha is not None:
            method, config = self.driver.alpha
            return method, dict(config)
        return self.config.alpha_method, dict(self.config.alpha_kwargs)

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` holds new samples back now."""
        return self.driver.paused

    def _require_versioned(self, role: Role) -> None:
        """Refuse new weights or labels for a teacher of several: samples record θ's version and the leading
        teacher's only, so another teacher's new weights would be drawn from unrecorded."""
        require(
            self.roster == PAIR or role == Role.THETA,
            f"role: new weights or labels for one of several teachers ({', '.join(self.roster.teachers)}) are not "
            "built yet",
        )

    def _update(self, role: str, weights: Any, version: str | None, mode: str, follow_symlinks: bool = True) -> str:
        self._check_open()
        check_update(role, mode, version)
        role = Role(role)
        self._require_versioned(role)
        with prepared_update(self._weights_check(role), weights, role, follow_symlinks, self._is_draft(role)) as load:
            return self._load(role, load, version, mode)

    def weight_sync(self, role: str = "theta") -> WeightSync:
        """vLLM's weight-sync client for ``role``'s weights: ``init_weight_transfer_engine``, ``start_weight_update``,
        ``update_weights`` (a chunk of the shared-memory weight-transfer engine, :mod:`processors.weight_transfer`)
        and ``finish_weight_update``, as vLLM's ``VLLMWeightSyncClient`` protocol names them, so vLLM's trainer-side
        engines can drive it in-process. Each chunk is checked as it comes; the update loads at finish, as
        :meth:`update_theta` does (the requests in flight finish first). One per model, shared (the server's routes
        use θ's). Thread-safe."""
        self._check_open()
        role = Role.parse(role)
        self._require_versioned(role)
        if role not in self._weight_syncs:

            def apply(load: Load, version: str | None) -> str:
                check_update(version=version)
                return self._load(role, load, version, "wait")

            # setdefault: two threads asking at once get the same client (one may build a spare).
            self._weight_syncs.setdefault(
                role, WeightSync(self._weights_check(role), role.value, apply, self._is_draft(role))
            )
        return self._weight_syncs[role]

    def _weights_check(self, role: Role) -> WeightsCheck:
        """The checkpoint names and shapes new weights of ``role`` are checked against (read once)."""
        if role not in self._weights_checks:
            self._weights_checks[role] = WeightsCheck(self.config.model_engine(role).folder)
        return self._weights_checks[role]

    def _is_draft(self, role: Role) -> bool:
        """Whether ``role`` is its engine's draft model (θ in a mode without a θ engine), which vLLM updates only
        through its weight-transfer engine's draft start."""
        return role == Role.THETA and not self.mode.theta_engine

    def _load(self, role: Role, load: Load, version: str | None, mode: str) -> str:
        return self.driver.call(self.driver.update_weights(role, load, mode=mode, version=version))

    # ------------------------------------------------------------------ asyncio API

    async def stream(
        self,
        prompt: str | Sequence[int],
        teacher_prompt: TeacherPrompt | None = None,
        *,
        sampling: SamplingOptions | None = None,
        sample_key: int | str = 0,
        sample_index: int = 0,
        request_id: str | None = None,
        teachers: Sequence[str] | None = None,
        **options: Any,
    ) -> AsyncIterator[SampleDelta]:
        """Draw one sample and yield its tokens as they come, from any asyncio loop.

        The sample is drawn with the seed derived from (seed, sample_key, sample_index), as
        sample ``sample_index`` of prompt ``sample_key`` in :meth:`generate`; ``teachers`` as there. The last delta
        carries the verified :class:`SampleRecord` (with its user score, where ``score`` is set). :meth:`abort` with
        ``request_id``, or
        cancelling the task, ends the request on both engines.
        """
        self._check_open()
        opts = sampling or self._options(**options)
        require(not opts.use_beam_search, "use_beam_search returns whole beams: use generate(), not stream()")
        seed = derive_seed(opts.seed, sample_key, sample_index)
        request = self.request(self.prepare(prompt, teacher_prompt), opts, seed, teachers=teachers)
        request.request_id = request_id
        async for delta in self.driver.thread.bridge(self.driver.stream(request)):
            if delta.sample is not None and opts.score is not None:  # the user score runs here, in the caller's loop
                delta = dataclasses.replace(delta, sample=scored(delta.sample, prompt, opts.score))
            yield delta

    def abort(self, request_id: str) -> bool:
        """End the request ``request_id`` on both engines (its sample ends with finish_reason "abort"). Thread-safe."""
        return self.driver.abort(request_id)

    async def complete(
        self, prompt: str | Sequence[int], teacher_prompt: TeacherPrompt | None = None, **kwargs: Any
    ) -> SampleRecord:
        """Draw one sample and return it whole, from any asyncio loop (see :meth:`stream`)."""
        async for delta in self.stream(prompt, teacher_prompt, **kwargs):
            if delta.sample is not None:
                return delta.sample
        raise RuntimeError("the sample's stream ended without its final record")

    # ------------------------------------------------------------------ building requests

    def _options(self, **options: Any) -> SamplingOptions:
        unsupported = sorted(set(options) - {f for f in SamplingOptions.__dataclass_fields__})
        if unsupported:
            refused = [u for u in unsupported if u in UNSUPPORTED_SAMPLING]
            why = " (bad words would act after the token is forced)" if refused else ""
            raise ValueError(
                f"unsupported sampling options: {', '.join(unsupported)}{why}; supported: "
                f"{', '.join(SamplingOptions.__dataclass_fields__)}"
            )
        opts = SamplingOptions(**options)
        opts.check_vocab(self.vocab, self.eos_token_ids)
        return opts

    def request(
        self,
        pair: PromptPair,
        opts: SamplingOptions,
        seed: int,
        group: int = 0,
        member: int = 0,
        teachers: Sequence[str] | None = None,
    ) -> DualRequest:
        """The request for one sample of a prepared prompt pair (:meth:`prepare`); ``group`` and ``member`` place it in
        its diverse group; ``teachers``: the teachers it mixes (:meth:`generate`)."""
        require(
            len(self.roster.teachers) == 1 or not opts.ranked_by.startswith("logp_teacher"),
            f"best_of_score={opts.ranked_by!r}: with several teachers there is no one teacher's log π to rank by",
        )
        row = opts.row(seed, self.eos_token_ids, pair.theta_ids, group, member, opts.draws if group else 1)
        check_stages_for_teachers([row], len(self.roster.teachers))  # refused here, not failed in the engine
        return DualRequest(
            _copied(pair.teacher_ids),
            list(pair.theta_ids),
            row,
            min(opts.max_tokens, pair.room),
            tuple(opts.stop),
            teachers=None if teachers is None else self.teacher_set(teachers),
        )

    def teacher_set(self, teachers: Sequence[str]) -> tuple[str, ...]:
        """``teachers`` as a request's teacher set (``generate(..., teachers=...)``), in roster order; ValueError
        naming the field for one this engine cannot take."""
        return check_teacher_set(teachers, self.roster)

    def record_columns(self, teachers: Sequence[str] | None = None) -> tuple[str, ...]:
        """The per-token record columns of a request that mixes ``teachers`` (None: all), in roster order: a teacher
        left out has its α column (zeros) and no log π column."""
        return request_columns(self.roster, teachers)

    def check(self, pair: PromptPair, opts: SamplingOptions, teachers: Sequence[str] | None = None) -> None:
        """Refuse, with a ValueError that begins with the field's name, a prompt pair and options this engine cannot
        serve (with the teachers a request names): the checks a sample's start runs, for callers that answer before
        starting (the server)."""
        if opts.use_beam_search:
            self._require_beam_search("use_beam_search")
        self.driver.check(self.request(pair, opts, opts.seed, teachers=teachers))

    def prepare(self, prompt: str | Sequence[int], teacher_prompt: TeacherPrompt | None = None) -> PromptPair:
        """One prompt tokenized for each engine (theta's ``prompt``; the teacher's ``teacher_prompt``, or the same),
        with the room it leaves for generated tokens. ValueError, naming the prompt, for an empty prompt, token ids
        outside the vocabulary, or a prompt that leaves no room in max_model_len."""
        if teacher_prompt is None:
            teacher = None
        elif isinstance(teacher_prompt, Mapping):
            teacher = {name: [p] for name, p in teacher_prompt.items()}
        else:
            teacher = [teacher_prompt]
        (pair,) = prompt_pairs(self.tokenizer, self.vocab, self.max_model_len, [prompt], teacher, self.roster)
        return pair

    # ------------------------------------------------------------------ state

    @property
    def session(self):
        """The shared-memory session (for monitoring)."""
        return self.driver.session

    def get_sync_statistics(self) -> dict[str, float | str]:
        """Counters from the engines' plugins and the driver: rows, waits, timeouts, plans, requests (``in_flight``
        on the engines and ``queued`` for a slot now), finishes and failures, weight updates per role; and the row
        channel's transport, ``row_transport`` ("host", "pinned" or "device")."""
        return self.driver.statistics()

    def engine_pids(self) -> dict[str, list[int]]:
        """Process ids of each engine (its EngineCore, then its workers), by role."""
        engines = self.driver.engines
        return engines.pids() if engines is not None else {}

    @property
    def failure(self) -> SyncError | None:
        """Why this instance serves nothing more (an :class:`EnginePairDead`), or None while it serves."""
        return self.driver.failure

    def healthy(self) -> bool:
        """Both engines run: none exited, vLLM declared none dead, and the instance is open."""
        engines = self.driver.engines
        return self.driver.alive and engines is not None and engines.dead() is None

    def _check_open(self) -> None:
        if self.driver.failure is not None:
            raise type(self.driver.failure)(f"{self.driver.failure} (this OptimalSamplingDual is closed)")

    def close(self) -> None:
        """Stop both engines and remove the shared memory (an unfinished weight update's chunks too). Safe to call
        twice."""
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.close()  # first: an update waiting on the driver then fails and lets its sync go
        for sync in getattr(self, "_weight_syncs", {}).values():
            sync.shutdown_weight_transfer_engine()

    def __enter__(self) -> OptimalSamplingDual:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self, _suppress=contextlib.suppress) -> None:  # bound now: at interpreter exit the globals may be gone
        with _suppress(Exception):
            self.close()


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread like Ctrl-C does, so the engines and the shared memory are released.

    Only when nothing else handles SIGTERM (its default action would kill the driver on the
    spot and leave the engines to notice on their own).
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
