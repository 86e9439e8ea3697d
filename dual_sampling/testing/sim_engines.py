"""Simulated engines that run the real lockstep plugins and serve the real driver: a pair, or any roster.

What is real: every engine's scheduler plugin (subclasses of vLLM's own ``Scheduler``, with
vLLM's queues, token budget and KV cache manager), every logits processor, the shared
memory, and the driver (``dual_sampling.driver.lockstep_driver.LockstepDriver``). What is simulated:

- the **EngineCore loop** (:class:`SimEngineCore`, one thread per engine): it reads its
  input with a delivery delay of its own per message, counted in turns of the loop (not in
  seconds, so a run is a function of its drawn data), steps when vLLM's scheduler has work,
  and sends the outputs to its frontend;
- the **model runner**: a persistent batch updated the way vLLM's V1 runner does it
  (finished and unscheduled requests removed, new ones added into holes, rows condensed
  by one-way moves, random SWAPs), ``BatchUpdate``/``apply`` called as vLLM calls them, and
  logits that are a fixed function of (side, sample seed, position, engine step), so a
  record can be recomputed from scratch and a row computed at another step than its
  partner's is wrong (:func:`sim_logits`);
- the **frontend** (:class:`SimAsyncEngine`): ``generate()`` as ``AsyncLLM`` has it (DELTA or
  FINAL_ONLY outputs, a vLLM abort when the caller goes away).

Adversity is chosen per run (:class:`Adversity`): uneven delivery delays per side, one
side's KV cache too small (vLLM then tries to preempt), prefix caching on one side only,
vLLM-level aborts sent to one engine only, a stalled engine, an engine that vLLM declares
dead while its process lives on.

One module over 500 lines: the simulated core, runner and frontend share one request model
and one clock of steps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.structured_output import StructuredOutputManager

from alpha import geometric_mix, get_alpha_computer
from dual_sampling.lockstep import CONFIG_KEY, LockstepConfig
from dual_sampling.roster import PAIR
from processors import (
    FollowerLogitsProcessor,
    FollowerScheduler,
    LeaderLogitsProcessor,
    LeaderScheduler,
)

VOCAB = 64
"""Sim vocabulary: SmolLM2's first 64 ids (17 onwards decode to single ASCII characters)."""
EOS = 0
BLOCK = 16
NAN_STEP = 2
"""Step at which a sample whose seed is in ``Adversity.nan_seeds`` gets NaN logits."""


def sim_logits(side: str, seed: int, position: int, step: int) -> torch.Tensor:
    """The simulated model's logits: a fixed function of (side, sample seed, position, engine step).

    ``side`` is the model's name in the roster ("teacher" and "theta" in a pair; any other name is a model of its
    own). ``position`` counts the sample's generated tokens; ``step`` is the engine's own count of steps that
    scheduled tokens (:attr:`SimEngineCore.batches`). The engines count the same steps only if they run in lockstep,
    so a row computed one step out of phase with its partners' differs from the one the record oracle recomputes.
    """
    key = ((seed * 1_000_003 + position) * 1_000_033 + step) * 2 + (side == "theta")
    if side not in ("teacher", "theta"):
        key = key * 1_000_037 + zlib.crc32(side.encode())
    g = torch.Generator().manual_seed(key % (1 << 62))
    return torch.randn(VOCAB, generator=g) * {"teacher": 3.0, "theta": 1.5}.get(side, 2.0)


@dataclass
class Adversity:
    """What goes wrong in one simulated run."""

    delay_turns: dict[str, int] = field(default_factory=lambda: {"teacher": 0, "theta": 0})
    """Largest delivery delay of a message to each engine, in turns of that engine's loop (each message draws its
    own). A turn is one step, or one poll of at most 10 ms while the engine has nothing to step."""
    kv_blocks: dict[str, int] = field(default_factory=dict)
    """KV cache blocks per side; missing: enough for every seat at full length."""
    prefix_caching: frozenset = frozenset()
    """The sides whose vLLM scheduler has prefix caching on (the others have it off): their prefills may schedule
    fewer tokens than the other side's for the same step."""
    one_sided_abort_rate: float = 0.0
    """Chance that a request also gets a vLLM-level abort sent to one engine only."""
    nan_seeds: frozenset = frozenset()
    nan_side: str = "theta"
    """The side whose logits get NaN at NAN_STEP for the samples in ``nan_seeds``."""
    wrong_token_seeds: frozenset = frozenset()
    """Samples for which theta's engine emits a token other than the one forced, at step 1 (a broken engine)."""
    stall: tuple[str, int, int] | None = None
    """(side, at_step, for_turns): once that engine ("teacher", "theta" or "both") has run ``at_step`` steps that
    scheduled tokens, it stops stepping for ``for_turns`` turns of its loop in which it has requests (each a 10 ms
    sleep). Counted in the engine's own steps and turns, not in seconds, so where a stall strikes is a function of
    the run's data."""
    engine_dead: tuple[str, int] | None = None
    """(side, at_step): once that engine has run ``at_step`` steps it stops stepping and its frontend turns
    ``errored``, raising EngineDeadError to every call in flight and every later one, as AsyncLLM does after an
    exception inside its EngineCore; its thread (the process) stays alive. :meth:`SimEngineCore.declare_dead` does
    the same on demand."""
    theta_step_offset: int = 0
    """A broken theta runner, for positive controls only: theta computes its logits as if at its step plus this
    offset, i.e. out of phase with the teacher. The record oracle (:func:`check_records`) must catch it."""


class SimEngineCore(threading.Thread):
    """One engine: vLLM's scheduler (our plugin) and our processor, with a simulated loop and model."""

    def __init__(
        self, side: str, vllm_config: Any, num_blocks: int, rng: random.Random, adversity: Adversity, deliver
    ) -> None:
        super().__init__(name=f"sim-{side}", daemon=True)
        self.side, self.adversity, self.deliver = side, adversity, deliver
        # One stream per thread that draws: the caller's thread draws delivery delays, the engine's thread the
        # runner's swaps; a shared stream would interleave them by the threads' timing.
        self.delivery_rng, self.runner_rng = random.Random(rng.random()), random.Random(rng.random())
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
        kv = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)]
        )
        leads = engine_lockstep(vllm_config).leads
        scheduler_cls = LeaderScheduler if leads else FollowerScheduler
        processor_cls = LeaderLogitsProcessor if leads else FollowerLogitsProcessor
        self.scheduler = scheduler_cls(
            vllm_config, kv, StructuredOutputManager(vllm_config), block_size=BLOCK, hash_block_size=BLOCK
        )
        self.processor = processor_cls(vllm_config, torch.device("cpu"), False)
        self.block_hasher = None
        """What EngineCore gives each Request when prefix caching is on: the hashes its cache looks up."""
        if vllm_config.cache_config.enable_prefix_caching:
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            init_none_hash(sha256)
            self.block_hasher = get_request_block_hasher(BLOCK, sha256)
        self._inbox: list = []
        self._inbox_lock = threading.Condition()
        self._seq = itertools.count()
        self.turns = 0
        """Turns of this engine's loop so far: the clock of its delivery delays."""
        self.batch: list[str | None] = []
        self.outputs_of: dict[str, list[int]] = {}
        self.params_of: dict[str, SamplingParams] = {}
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.stalled_turns = 0
        """Turns spent in :attr:`Adversity.stall` so far."""
        self._declared_dead = threading.Event()
        self.on_schedule = lambda scheduler_output: None
        """Called in this engine's thread with each step's scheduler output, before the model runs."""
        self.on_death = lambda: None
        """Called once when ``Adversity.engine_dead`` strikes this engine (its frontend's ``die``)."""
        self.dead = False
        self.batches: list[tuple[tuple[str, int], ...]] = []
        """An observer outside the plugins: each step's scheduled (request id, tokens), in step order, as vLLM's
        scheduler output gives them (steps that schedule nothing are left out)."""
        self.token_steps: dict[int, list[int]] = {}
        """Per sample seed, the index in :attr:`batches` of the step that computed each of its tokens."""
        self.pausing: Any = None
        """Called once a pause with ``keep`` completes: as vLLM's EngineCore does, once the engine is idle (it steps
        meanwhile while it has ended requests to report), and then with the KV cache reset, its running requests
        preempted."""

    # ------------------------------------------------------------------ input, with delays

    def send(self, kind: str, payload: Any) -> None:
        with self._inbox_lock:
            due = self.turns + self.delivery_rng.randint(0, self.adversity.delay_turns.get(self.side, 0))
            heapq.heappush(self._inbox, (due, next(self._seq), kind, payload))
            self._inbox_lock.notify()

    def _read_inputs(self, block: bool) -> None:
        with self._inbox_lock:
            self.turns += 1
            if block and not self._due():
                self._inbox_lock.wait(0.01)
            items = []
            while self._due():
                items.append(heapq.heappop(self._inbox))
        for _, _, kind, payload in items:
            if kind == "add":
                self.scheduler.add_request(payload)
            elif kind == "pause":  # vLLM's pause_scheduler with mode="keep" and clear_cache
                self.scheduler.set_pause_state(PauseState.PAUSED_ALL)
                self.pausing = payload
            elif kind == "resume":
                self.scheduler.set_pause_state(PauseState.UNPAUSED)
                payload()
            else:
                self.scheduler.finish_requests(payload, RequestStatus.FINISHED_ABORTED)  # as EngineCore.abort_requests

    def _due(self) -> bool:
        return bool(self._inbox) and self._inbox[0][0] <= self.turns

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                self._read_inputs(block=not self.scheduler.has_requests())
                if self._declared_dead.is_set() or self._struck(self.adversity.engine_dead):
                    if not self.dead:
                        self.dead = True
                        self.on_death()
                    time.sleep(0.01)
                    continue
                stall = self.adversity.stall
                if self._struck(stall) and self.stalled_turns < stall[2]:
                    self.stalled_turns += self.scheduler.has_requests()  # an idle turn stalls nothing
                    time.sleep(0.01)
                    continue
                if self.scheduler.has_requests():
                    self._step()
                if self.pausing is not None and not self.scheduler.has_requests():
                    self.scheduler.reset_prefix_cache(reset_running_requests=True)
                    self.pausing, done = None, self.pausing
                    done()
        except BaseException as exc:  # the driver sees the engine die
            self.error = exc

    def _struck(self, adversity: tuple | None) -> bool:
        """Whether a (side, at_step, ...) adversity applies to this engine now."""
        return adversity is not None and adversity[0] in (self.side, "both") and len(self.batches) >= adversity[1]

    def declare_dead(self) -> None:
        """From any thread: at its next turn this engine does what :attr:`Adversity.engine_dead` makes it do."""
        self._declared_dead.set()

    def _step(self) -> None:
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens:
            self.batches.append(tuple(sorted(so.num_scheduled_tokens.items())))
        self.on_schedule(so)
        mro = self._execute(so)
        outputs = self.scheduler.update_from_output(so, mro)
        for eco in outputs.values():
            if eco.outputs:
                self.deliver(eco.outputs)
        if not so.total_num_scheduled_tokens:
            time.sleep(0.001)

    def _execute(self, so) -> ModelRunnerOutput:
        """The V1 model runner's persistent-batch bookkeeping, our processor, and a fixed 'model'."""
        scheduled = so.num_scheduled_tokens
        removed, added, moved = [], [], []
        for i, rid in enumerate(self.batch):
            if rid is not None and (rid in so.finished_req_ids or rid not in scheduled):
                removed.append(i)
                self.batch[i] = None
        for rid in so.finished_req_ids:
            self.outputs_of.pop(rid, None)
            self.params_of.pop(rid, None)
        present = set(self.batch)
        for new in so.scheduled_new_reqs:
            self.outputs_of[new.req_id] = []
            self.params_of[new.req_id] = new.sampling_params
        for rid in scheduled:
            if rid in present:
                continue
            holes = [i for i, x in enumerate(self.batch) if x is None]
            index = holes[0] if holes else len(self.batch)
            if index == len(self.batch):
                self.batch.append(None)
            self.batch[index] = rid
            added.append((index, self.params_of[rid], [1, 2, 3], self.outputs_of[rid]))
        while None in self.batch:  # condense: move the last rows into holes, one way
            hole = self.batch.index(None)
            last = max((i for i, x in enumerate(self.batch) if x is not None), default=-1)
            if last < hole:
                del self.batch[hole:]
                break
            self.batch[hole], self.batch[last] = self.batch[last], None
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        if len(self.batch) > 1 and self.runner_rng.random() < 0.5:
            a, b = self.runner_rng.sample(range(len(self.batch)), 2)
            self.batch[a], self.batch[b] = self.batch[b], self.batch[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        self.processor.update_state(
            BatchUpdate(len(self.batch), removed, added, moved) if removed or added or moved else None
        )
        if not self.batch:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={})
        seeds = [self.params_of[rid].extra_args["dual_sampling"]["sampling"]["seed"] for rid in self.batch]
        step = len(self.batches) - 1  # this step scheduled tokens (the runner is called only then)
        if self.side == "theta":
            step += self.adversity.theta_step_offset
        logits = torch.stack(
            [sim_logits(self.side, seed, len(self.outputs_of[rid]), step) for seed, rid in zip(seeds, self.batch)]
        )
        if self.side == self.adversity.nan_side:
            for i, (seed, rid) in enumerate(zip(seeds, self.batch)):
                if seed in self.adversity.nan_seeds and len(self.outputs_of[rid]) == NAN_STEP:
                    logits[i, VOCAB // 2] = math.nan
        logits = self.processor.apply(logits)
        tokens = []
        for i, (seed, rid) in enumerate(zip(seeds, self.batch)):
            assert int(torch.isfinite(logits[i]).sum()) == 1, "every row must allow exactly one token"
            tokens.append(int(logits[i].argmax()))
            if self.side == "theta" and seed in self.adversity.wrong_token_seeds and len(self.outputs_of[rid]) == 1:
                tokens[-1] = 17 + (tokens[-1] - 16) % (VOCAB - 17)  # a different, ordinary token
            self.outputs_of[rid].append(tokens[-1])
            self.token_steps.setdefault(seed, []).append(step)
        return ModelRunnerOutput(
            req_ids=list(self.batch),
            req_id_to_index={rid: i for i, rid in enumerate(self.batch)},
            sampled_token_ids=[[t] for t in tokens],
        )


class SimAsyncEngine:
    """The frontend of one simulated engine, with ``AsyncLLM.generate``'s behaviour."""

    def __init__(
        self, core: SimEngineCore, rng: random.Random, adversity: Adversity, partner: SimAsyncEngine | None = None
    ):
        self.core, self.rng, self.adversity = core, rng, adversity
        self.partner = partner
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.errored = False
        """AsyncLLM's flag: the engine is dead for good."""

    def deliver(self, outputs: list) -> None:
        for out in outputs:
            target = self.queues.get(out.request_id)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def die(self) -> None:
        """What AsyncLLM's output handler does once its EngineCore reports a fatal error."""
        self.errored = True
        for loop, inbox in list(self.queues.values()):
            loop.call_soon_threadsafe(inbox.put_nowait, EngineDeadError())

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """``AsyncLLM.pause_generation`` for the one mode the driver holds requests with."""
        assert mode == "keep" and clear_cache, (mode, clear_cache)
        await self._utility("pause")

    async def resume_generation(self) -> None:
        await self._utility("resume")

    async def _utility(self, kind: str) -> None:
        """Send ``kind`` through the engine's input (with its delivery delays) and wait until the engine did it."""
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        self.core.send(kind, lambda: loop.call_soon_threadsafe(done.set))
        await done.wait()

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str):
        if self.errored:
            raise EngineDeadError()
        params = params.clone()
        params._eos_token_id = EOS
        params._all_stop_token_ids = set(params.stop_token_ids or ()) | {EOS}
        request = Request(
            request_id, list(prompt["prompt_token_ids"]), params, None, block_hasher=self.core.block_hasher
        )
        inbox: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = (asyncio.get_running_loop(), inbox)
        self.core.send("add", request)
        if self.rng.random() < self.adversity.one_sided_abort_rate:
            self.core.send("abort", [request_id])  # a vLLM abort reaching this engine alone
        tokens: list[int] = []
        try:
            while True:
                out = await inbox.get()
                if isinstance(out, EngineDeadError):
                    raise out
                tokens += out.new_token_ids
                finished = out.finish_reason is not None
                if params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                shown = tokens if params.output_kind == RequestOutputKind.FINAL_ONLY else list(out.new_token_ids)
                reason = str(out.finish_reason) if finished else None
                yield RequestOutput(
                    request_id,
                    None,
                    request.prompt_token_ids,
                    None,
                    [CompletionOutput(0, "", shown, None, None, finish_reason=reason, stop_reason=out.stop_reason)],
                    finished,
                )
                if finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.core.send("abort", [request_id])
            raise
        finally:
            self.queues.pop(request_id, None)


class SimEnginePair:
    """One simulated engine per model of the configs' roster (``configs``: name to vLLM config, in roster order), with
    :class:`dual_sampling.driver.pair.EnginePair`'s interface for a pair."""

    def __init__(
        self,
        session_name: str,
        configs: dict,
        rng: random.Random,
        adversity: Adversity,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        full = max_num_seqs * -(-max_model_len // BLOCK) + 1
        self.cores, self.engines = {}, {}
        for side, cfg in configs.items():
            join_session(cfg, session_name)
            engine = SimAsyncEngine(None, random.Random(rng.random()), adversity)
            core = SimEngineCore(
                side, cfg, adversity.kv_blocks.get(side, full), random.Random(rng.random()), adversity, engine.deliver
            )
            engine.core, core.on_death = core, engine.die
            self.cores[side], self.engines[side] = core, engine
        for core in self.cores.values():
            core.start()

    @property
    def teacher(self) -> SimAsyncEngine:
        return self.engines["teacher"]

    @property
    def theta(self) -> SimAsyncEngine:
        return self.engines["theta"]

    def worker_cpu_seconds(self) -> float:
        return 0.0  # the simulated engines are threads of this process: they never look busy

    def dead(self) -> str | None:
        for side, core in self.cores.items():
            if core.error is not None or not core.is_alive():
                return side
        return None

    def pids(self) -> dict:
        return {}

    def close(self) -> None:
        for core in self.cores.values():
            core.stop_flag.set()
        for core in self.cores.values():
            core.join(timeout=10)
        for core in self.cores.values():
            core.scheduler.shutdown()


def sim_configs(
    max_num_seqs: int,
    max_model_len: int,
    budget: int,
    sync_timeout: float,
    prefix_caching: frozenset = frozenset(),
    roster: tuple[str, ...] = PAIR.names,
    alpha_method: str = "kl_symmetry",
    alpha_config: dict | None = None,
) -> dict:
    """vLLM configs of the simulated engines, one per model of ``roster`` in its order (the tiny models' folders;
    nothing is loaded); ``prefix_caching``: the sides with vLLM's prefix caching on."""
    from vllm.engine.arg_utils import EngineArgs

    from dual_sampling.testing import tiny_models

    teacher, theta = tiny_models.tiny_pair("same")
    out = {}
    for side in roster:
        path = theta if side == "theta" else teacher
        lockstep = LockstepConfig(side, "", sync_timeout, alpha_method, alpha_config or {}, roster=roster)
        args = EngineArgs(
            model=str(path),
            tokenizer=str(teacher),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=False,
            async_scheduling=False,
            enforce_eager=True,
            dtype="float32",
            skip_tokenizer_init=True,
            enable_prefix_caching=side in prefix_caching,
            additional_config=lockstep.to_engine(),
        )
        out[side] = args.create_engine_config()
    return out


def engine_lockstep(config: Any) -> LockstepConfig:
    """The lockstep settings in a simulated engine's vLLM config (from :func:`sim_configs`)."""
    return LockstepConfig(**config.additional_config[CONFIG_KEY])


def join_session(config: Any, session_name: str) -> None:
    """Point a simulated engine's vLLM config (from :func:`sim_configs`) at the session ``session_name``."""
    config.additional_config.update(engine_lockstep(config).with_session(session_name).to_engine())


def check_records(sample, request, token_steps: dict[int, list[int]]) -> None:
    """Recompute α, log π_t, log π_θ and log q of every token from the fixed logits: a stale row fails here.

    ``token_steps`` is the *teacher* engine's :attr:`SimEngineCore.token_steps`: both sides' rows are recomputed at the
    teacher's step, so a theta row computed out of phase fails as stale. The request's min_tokens masking of the stop
    ids is applied to q as well.
    """
    ac = get_alpha_computer("kl_symmetry")
    steps = token_steps.get(sample.seed, [])
    assert len(steps) >= len(sample.token_ids), f"seed {sample.seed}: the teacher engine computed fewer tokens"
    for position, (tok, step) in enumerate(zip(sample.token_ids, steps)):
        lt = torch.log_softmax(sim_logits("teacher", sample.seed, position, step), -1)
        lth = torch.log_softmax(sim_logits("theta", sample.seed, position, step), -1)
        a = ac(lth, lt)
        logq = geometric_mix(lth, lt, a)
        if position < request.sampling.min_tokens:
            logq[[t for t in request.sampling.stop_token_ids if t < VOCAB]] = -math.inf
            logq = torch.log_softmax(logq, -1)
        where = f"seed {sample.seed} token {position} (teacher step {step})"
        assert math.isclose(sample.alpha[position], float(a), abs_tol=1e-5), f"{where}: alpha"
        assert math.isclose(sample.logp_theta[position], float(lth[tok]), abs_tol=1e-5), f"{where}: stale theta row"
        assert math.isclose(sample.logp_teacher[position], float(lt[tok]), abs_tol=1e-5), f"{where}: teacher row"
        assert math.isclose(sample.logq[position], float(logq[tok]), abs_tol=1e-5), f"{where}: log q"


# ---------------------------------------------------------------------- one simulated run


@dataclass
class SimRun:
    """The outcome of :func:`run_simulation`."""

    samples: list
    """SampleRecord per request, None where the request was cancelled by its caller."""
    requests: list
    aborted: set
    """Indices of requests the driver aborted."""
    stats: dict
    leaked_slots: list
    batches: dict
    """Per side, the observed batches of every step (:attr:`SimEngineCore.batches`)."""
    token_steps: dict
    """The teacher engine's step of every token, per sample seed (:attr:`SimEngineCore.token_steps`)."""
    acted: dict
    """Per request index, the moment (:data:`MOMENTS`) at which its abort or cancel acted."""
    held: list = field(default_factory=list)
    """With ``hold``: the slots held when the pause with ``keep`` took effect (one entry per hold)."""


_TOKENIZER = None


def sim_tokenizer():
    """SmolLM2's tokenizer (the sim's 64 ids are its specials and single characters)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from dual_sampling.testing import tiny_models

        _TOKENIZER = AutoTokenizer.from_pretrained(tiny_models.tiny_pair("same")[0])
    return _TOKENIZER


def make_requests(
    rng: random.Random,
    count: int,
    max_model_len: int,
    stops: tuple[str, ...] = (),
    min_tokens: int = 0,
    *,
    shared_prefix: dict[str, int] | None = None,
    near_full: float = 0.0,
) -> list:
    """Long teacher prompts and short theta ones (a hint on one side only), uneven lengths, random stop ids.

    ``shared_prefix`` (side: tokens) starts every prompt of that side with the same tokens, so a prefix cache there
    hits. ``near_full`` is the chance that a request's longer prompt leaves only 1 to 4 tokens of room in
    max_model_len (its max_tokens capped by that room, as ``OptimalSamplingDual`` caps it).
    """
    from dual_sampling.decision.pipeline import RowSampling
    from dual_sampling.driver.requests import DualRequest, generation_room

    shared = {side: [rng.randrange(17, VOCAB) for _ in range(n)] for side, n in (shared_prefix or {}).items()}
    out = []
    for _k in range(count):
        teacher_len, theta_len = rng.randint(max_model_len // 4, max_model_len // 2), rng.randint(1, 12)
        if rng.random() < near_full:
            left = rng.randint(1, 4)
            if rng.random() < 0.5:
                teacher_len = max_model_len - left
            else:
                theta_len = max_model_len - left
        prompts = {}
        for side, length in (("teacher", teacher_len), ("theta", theta_len)):
            head = shared.get(side, [])
            prompts[side] = head + [rng.randrange(17, VOCAB) for _ in range(max(1, length - len(head)))]
        room = generation_room(max_model_len, prompts["teacher"], prompts["theta"])
        max_tokens = min(rng.randint(max(1, min_tokens), 24), room)
        out.append(
            DualRequest(
                prompts["teacher"],
                prompts["theta"],
                RowSampling(
                    seed=rng.randrange(1 << 40),
                    min_tokens=min(min_tokens, max_tokens),
                    stop_token_ids=(EOS, rng.randrange(17, VOCAB)),
                ),
                max_tokens,
                stop=stops,
            )
        )
    return out


def sim_driver(
    rng: random.Random,
    adversity: Adversity,
    max_num_seqs: int,
    max_model_len: int,
    budget: int | None = None,
    sync_timeout: float = 10.0,
    slots: int | None = None,
):
    """The real driver (``LockstepDriver``) on two simulated engines; ``budget`` defaults to max_model_len."""
    from dual_sampling.driver.lockstep_driver import LockstepDriver

    configs = sim_configs(max_num_seqs, max_model_len, budget or max_model_len, sync_timeout, adversity.prefix_caching)
    return LockstepDriver(
        lambda name: SimEnginePair(name, configs, rng, adversity, max_num_seqs, max_model_len),
        sim_tokenizer(),
        vocab=VOCAB,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        sync_timeout=sync_timeout,
        slots=slots,
    )


MOMENTS = ("queued", "prefill", "decode")
"""When an abort or a cancel acts on its request, by state: waiting for a slot, while the teacher engine computes
its prefill, or once a drawn number of its tokens has streamed."""


def run_simulation(
    seed: int,
    count: int,
    max_num_seqs: int,
    adversity: Adversity | None = None,
    *,
    max_model_len: int = 96,
    budget: int | None = None,
    abort_rate: float = 0.0,
    cancel_rate: float = 0.0,
    stops: tuple[str, ...] = (),
    min_tokens: int = 0,
    sync_timeout: float = 10.0,
    slots: int | None = None,
    shared_prefix: dict[str, int] | None = None,
    near_full: float = 0.0,
    hold: tuple[int, float] | None = None,
) -> SimRun:
    """Run ``count`` requests through the real plugins and driver on two simulated engines.

    ``budget`` (tokens per step, default max_model_len) is small enough that one engine alone
    would admit long teacher prompts and short theta prompts at different steps.
    ``abort_rate`` aborts requests through the driver, ``cancel_rate`` has the caller walk away
    from the stream; each acts at a moment of :data:`MOMENTS` drawn per request, by the
    request's state, never by a timer (``SimRun.acted`` says which moment each reached).
    ``hold`` = (tokens, seconds): each time that many more tokens have streamed in all, the driver holds the requests
    in flight (``pause(mode="keep")``) that long, then resumes (``SimRun.held``: how many slots each hold held).
    """
    from dual_sampling.driver.loop_thread import as_coroutine

    rng = random.Random(seed)
    adversity = adversity or Adversity()
    requests = make_requests(
        rng, count, max_model_len, stops, min_tokens, shared_prefix=shared_prefix, near_full=near_full
    )
    driver = sim_driver(rng, adversity, max_num_seqs, max_model_len, budget, sync_timeout, slots)
    aborted: set = set()
    acted: dict[int, str] = {}
    plan = []
    for request in requests:
        abort, cancel = rng.random() < abort_rate, rng.random() < cancel_rate
        moment, after = rng.choice(MOMENTS), rng.randint(1, max(1, request.max_tokens - 1))
        plan.append(("abort" if abort else "cancel" if cancel else None, moment, after))
    at_prefill: dict[str, Any] = {}
    streamed_in_all = [0]
    held: list[int] = []
    holding: list[asyncio.Task] = []

    async def hold_then_resume() -> None:
        await driver.pause("keep")
        held.append(len(driver.session.held_slots()))
        await asyncio.sleep(hold[1])
        await driver.resume()

    def on_schedule(so) -> None:  # in the teacher engine's thread, between its schedule() and its model
        for new in so.scheduled_new_reqs:
            act = at_prefill.pop(new.req_id, None)
            if act is not None:
                asyncio.run_coroutine_threadsafe(as_coroutine(act), driver.loop).result(30)

    driver.engines.cores["teacher"].on_schedule = on_schedule

    async def one(index: int, request) -> Any:
        action, moment, after = plan[index]
        request.request_id = f"r{index}"
        task = None

        def act(where: str) -> None:
            if index in acted or task.done():
                return
            acted[index] = where
            if action == "abort":
                if driver.abort(request.request_id):
                    aborted.add(index)
            else:
                task.cancel()

        def on_tokens(streamed: int) -> None:
            streamed_in_all[0] += 1
            due = hold is not None and streamed_in_all[0] >= hold[0] * (len(holding) + 1)
            if due and (not holding or holding[-1].done()):
                holding.append(asyncio.ensure_future(hold_then_resume()))
            if action and moment == "decode" and streamed >= after:
                act("decode")

        task = asyncio.ensure_future(_drain(driver.stream(request), on_tokens))
        if action and moment != "decode":
            await asyncio.sleep(0)  # the stream starts: it holds a slot now, or waits for one
            if moment == "queued" and request.request_id not in driver.in_flight():
                act("queued")
            else:
                at_prefill[request.request_id] = lambda: act("prefill")
        try:
            return await task
        except asyncio.CancelledError:
            return None

    async def main() -> list:
        samples = list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        await asyncio.gather(*holding)
        return samples

    try:
        samples = driver.call(main(), timeout=300)
        deadline = time.monotonic() + 5  # the engines release finished requests at their next step
        leaked = driver.session.held_slots()
        while leaked and time.monotonic() < deadline:
            time.sleep(0.02)
            leaked = driver.session.held_slots()
        stats = driver.statistics()
        cores = driver.engines.cores
    finally:
        driver.close()
    batches = {side: cores[side].batches for side in cores}
    return SimRun(samples, requests, aborted, stats, leaked, batches, cores["teacher"].token_steps, acted, held)


async def _drain(stream, on_tokens=lambda streamed: None) -> Any:
    """The final sample of a stream, after checking that the streamed deltas add up to it.

    ``on_tokens`` is called with the number of tokens streamed so far after each delta.

    Records too: a sample's streamed records are its own, and a failed sample streams none for the step it failed at
    or later (the slot's rows there may hold an earlier request's values).
    """
    streamed, records = [], []
    async for delta in stream:
        streamed += delta.token_ids
        records.append(delta.records)
        if delta.sample is None:
            on_tokens(len(streamed))
        else:
            sample = delta.sample
            assert streamed == sample.teacher_token_ids, "the streamed tokens differ from the teacher engine's"
            rows = np.concatenate(records) if records else np.zeros((0, 4))
            if sample.error is None:
                assert rows[:, 0].tolist() == sample.alpha and rows[:, 3].tolist() == sample.logq
            elif sample.error.split(" at ")[0] in ("bad_logits", "non_finite", "decision_error"):  # a failed row
                step = int(sample.error.rsplit(" ", 1)[1])
                assert len(rows) <= step, f"{len(rows)} records streamed for a sample that failed at step {step}"
            return sample
    raise AssertionError("stream ended without a sample")
