"""The vLLM engines of one session, one per model of the roster: built, verified, watched and stopped together.

:class:`EnginePair` starts one ``AsyncLLM`` per model (a pair: the teacher's and theta's) with the lockstep plugins
(``processors``), the first model's engine leading, then reads back each engine's *effective* configuration and
refuses any setting that would break lockstep, naming it. It knows its engines' processes (each
EngineCore and its workers), tells when one has died, and on :meth:`EnginePair.close`
leaves no process, no shared-memory file and no socket of theirs behind.

The module is over 500 lines because an engine's start, its checks, its processes and its stop share one record of
what was started (pids, shared-memory files, sockets), which a split would pass between modules.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from dual_sampling.driver import engine_processes, engine_start, placement
from dual_sampling.driver.lockstep_driver import LockstepDriver
from dual_sampling.lockstep import (
    LockstepConfig,
    segments_listing,
    write_listing,
)
from dual_sampling.lockstep.janitor import scratch_dir
from dual_sampling.lockstep.row_channel import resolve_transport
from dual_sampling.options import (
    DualEngineConfig,
    ModelEngine,
    default_kv_cache_bytes,
    kv_cache_bytes_needed,
    model_setting,
)
from dual_sampling.roster import THETA, Role, Roster

__all__ = ["LOCKSTEP_SETTINGS", "EnginePair", "qualified_name", "start_lockstep", "worker_problems"]

logger = logging.getLogger(__name__)

LOCKSTEP_SETTINGS = (
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "async_scheduling",
    "scheduler_cls",
    "logits_processors",
    "worker_extension_cls",
    "weight_transfer_config",
    "additional_config",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "speculative_config",
    "scheduling_policy",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
)
"""Engine arguments the dual engine sets itself; per-engine overrides of them are refused."""
_MiB = 1 << 20
_EXIT_WAIT_S = 10.0
"""How long close() waits for an engine's processes to exit after vLLM's shutdown before killing them."""
_LISTING_INTERVAL_S = 0.2
"""How often the listing of /dev/shm files is refreshed while the engines start."""


class EnginePair:
    """One ``AsyncLLM`` per model of ``config.roster`` (a pair: teacher and theta), in lockstep through the session
    ``session_name``; :attr:`engines` holds them by model name, in roster order (the leader first).

    Build it inside the asyncio loop that will use the engines (their clients bind to it).
    """

    def __init__(self, config: DualEngineConfig, session_name: str, max_model_len: int) -> None:
        self.config = config
        self.session_name = session_name
        self.max_model_len = max_model_len
        self.budget = config.max_num_batched_tokens or max(max_model_len, 2048)
        if self.budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.budget} is below max_model_len={max_model_len}: "
                "a full-length prompt could never be admitted"
            )
        for model in self.models.values():
            overridden = sorted(set(model.engine_kwargs) & set(LOCKSTEP_SETTINGS))
            if overridden:
                setting = model_setting(self.roster, model.name, "engine_kwargs")
                raise ValueError(
                    f"{setting} sets {', '.join(overridden)}; the dual engine sets these itself (use the "
                    "DualEngineConfig fields where one exists)"
                )
        self.places = self._place()
        """Each engine's GPU and share of its memory (``driver.placement``); empty off CUDA."""
        self.row_transport = _resolve_row_transport(config.row_transport, self.places, len(self.roster.names) - 1)
        """The row channel both engines open (``lockstep.row_channel``), resolved here, before either starts."""
        self.binding = (
            engine_processes.split_cpu_binding(self.roster.names, self._loads())
            if config.cpu_binding == "split"
            else {}
        )
        self.from_forkserver = not self.places and engine_start.warm()
        """Whether the engines' processes start from this process's fork server (``driver.engine_start``)."""
        self._core_pids: list[int] = []
        """The EngineCores' pids as they start (from the fork server, they are not this process's children)."""
        self.engines: dict[str, Any] = {}
        self._segments: set[str] = set()
        self._listed: set[str] = set()
        self._semaphores_before = engine_processes.semaphore_files()
        self.ipc_dir: Path | None = None
        """Where the engines' ZMQ sockets are (vLLM's VLLM_RPC_BASE_PATH), removed by close(); None when the user set
        VLLM_RPC_BASE_PATH (theirs to keep)."""
        try:
            self._start_both()
            self.verify()
            self._record_segments(self._all_pids())
        except BaseException:
            self.close()
            raise

    @property
    def roster(self) -> Roster:
        """The models by name, the leading engine's first."""
        return self.config.roster

    @property
    def models(self) -> dict[str, ModelEngine]:
        """Each model's folder and engine settings, by name, in roster order."""
        return {model.name: model for model in self.config.model_engines()}

    @property
    def teacher(self) -> Any:
        """A pair's teacher engine (the leader)."""
        return self.engines["teacher"]

    @property
    def theta(self) -> Any:
        return self.engines[THETA]

    # ------------------------------------------------------------------ start

    @property
    def started(self) -> tuple[str, ...]:
        """The models whose engines this pair starts, by name: every model of the roster (GPU placement plans
        them)."""
        return self.roster.names

    def kv_cache_bytes(self, name: str) -> int:
        """The KV cache the engine of model ``name`` gets, in bytes: ``kv_cache_memory_bytes``, or room for
        max_num_seqs full contexts at the engine's own dtype (vLLM's cache takes the model's)."""
        cfg, model = self.config, self.models[name]
        dtype = placement.engine_dtype(cfg, model)
        return cfg.kv_cache_memory_bytes or default_kv_cache_bytes(
            model.folder, cfg.max_num_seqs, self.max_model_len, dtype
        )

    def _loads(self) -> list[int] | None:
        """Each model's weights at its engine's dtype, in bytes (its engine's share of a step's work), where there are
        more engines than CPUs and the CPU binding places them by it; else None (no weight file is read)."""
        if len(self.models) <= len(os.sched_getaffinity(0)):
            return None
        return [placement.weight_bytes(m.folder, placement.engine_dtype(self.config, m)) for m in self.models.values()]

    def engine_need_bytes(self, name: str) -> int:
        """The least GPU memory the engine of model ``name`` can run in (its weights and KV cache)."""
        model = self.models[name]
        dtype = placement.engine_dtype(self.config, model)
        return placement.engine_need_bytes([model.folder], dtype, self.kv_cache_bytes(name))

    def _place(self) -> dict[str, placement.EnginePlace]:
        """Each engine's place on CUDA, checked before any starts (off CUDA, placement settings are refused)."""
        from vllm.platforms import current_platform

        models = self.config.model_engines()
        placement.check_placement_settings(self.config, models, self.roster, current_platform.device_type)
        if current_platform.device_type != "cuda":
            return {}
        # NVML's figures: no CUDA context is made in this process, which would take memory on the engines' GPU.
        gpu_bytes = [current_platform.get_device_total_memory(i) for i in range(current_platform.device_count())]
        started = tuple(m for m in models if m.name in self.started)
        needs = {m.name: self.engine_need_bytes(m.name) for m in started}
        return placement.plan_placement(started, self.roster, needs, gpu_bytes, os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _placement_kwargs(self, role: Role) -> dict[str, Any]:
        place = self.places.get(role)
        return {"gpu_memory_utilization": place.memory_share} if place else {}

    def _engine_variables(self, role: str) -> dict[str, str]:
        """The environment variables the engine processes of model ``role`` start with on top of this process's: its
        CPUs (``cpu_binding``) and its GPU (``driver.placement``)."""
        place = self.places.get(role)
        variables = {
            "VLLM_CPU_OMP_THREADS_BIND": self.binding.get(role),
            "CUDA_VISIBLE_DEVICES": place and place.visible_devices,
        }
        return {name: value for name, value in variables.items() if value is not None}

    def base_kwargs(self, model: str, kv_bytes: int) -> dict[str, Any]:
        """The vLLM engine arguments every engine of a dual engine starts with (lockstep's and the speculative one)."""
        from processors import DualSamplingWorkerExtension
        from processors.weight_transfer import ENGINE_NAME

        cfg = self.config
        return dict(
            model=model,
            tokenizer=cfg.tokenizer_folder,  # one tokenizer for all: the same stop ids and EOS on every side
            dtype=cfg.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=self.budget,
            # A partial prefill would hand the processors a logits row that vLLM then discards.
            enable_chunked_prefill=False,
            # The decision needs each step's tokens before the next step is scheduled.
            async_scheduling=False,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=0,
            generation_config="vllm",
            disable_log_stats=True,
            # Weight and alpha updates go through it: vLLM's reload alone leaves a tied output projection stale on
            # the CPU.
            worker_extension_cls=qualified_name(DualSamplingWorkerExtension),
            # New weights from a state dict come through vLLM's weight-transfer protocol, over shared memory.
            weight_transfer_config={"backend": ENGINE_NAME},
        )

    def engine_kwargs(self, role: str) -> dict[str, Any]:
        """The vLLM engine arguments of model ``role``'s engine."""
        from processors import (
            FollowerLogitsProcessor,
            FollowerScheduler,
            LeaderLogitsProcessor,
            LeaderScheduler,
        )

        cfg, model = self.config, self.models[role]
        leads = role == self.roster.names[0]
        kv_bytes = self.kv_cache_bytes(role)
        # The followers' CPUs that are not the leader's, lent to the leader's processor: each follower only waits for
        # the tokens while the leader decides.
        helper_cpus: tuple[int, ...] = ()
        if leads and self.binding:
            own = set(self.binding[role].split(","))
            lent = {c for name in self.roster.names[1:] for c in self.binding[name].split(",")} - own
            helper_cpus = tuple(sorted(int(c) for c in lent))
        kwargs = dict(
            self.base_kwargs(model.folder, kv_bytes),
            scheduler_cls=LeaderScheduler if leads else FollowerScheduler,
            logits_processors=[LeaderLogitsProcessor if leads else FollowerLogitsProcessor],
            **self._placement_kwargs(role),
            additional_config=LockstepConfig(
                role,
                self.session_name,
                cfg.sync_timeout,
                cfg.alpha_method,
                cfg.alpha_kwargs,
                # The followers' CPUs idle while the leader decides; it borrows them (see processors.leader).
                helper_cpus,
                self.row_transport,
                self.roster.names,
            ).to_engine(),
        )
        kwargs.update(model.engine_kwargs)
        return kwargs

    def _start_both(self) -> None:
        """Start both engines at once (from the fork server a few seconds; spawned, tens of seconds of imports).

        An engine's CPU binding is read from the environment its EngineCore process starts
        with: carried to it from the fork server, or, when spawned, switched to theta's binding
        only once the teacher's EngineCore exists.
        """
        # Engines create /dev/shm files while they start; listing them as they appear lets a later
        # session reclaim them if this driver is killed before both engines are up.
        children_before = engine_processes.children()
        started = threading.Event()
        lister = threading.Thread(
            target=self._list_while_starting, args=(children_before, started), name="dual-sampling-lister", daemon=True
        )
        lister.start()
        try:
            self._start_engines()
        finally:
            started.set()
            lister.join()

    def _start_engines(self) -> None:
        from processors.model_runner import prefer_v1_runner

        prefer_v1_runner()
        if "VLLM_RPC_BASE_PATH" not in os.environ:
            self.ipc_dir = scratch_dir("ipc")
        # On CUDA vLLM forks its engine processes unless told otherwise; a placed engine's environment is switched
        # once its process exists, which the pair sees for spawned processes only.
        spawn = "spawn" if self.places and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ else None
        ipc = str(self.ipc_dir) if self.ipc_dir else None
        with (
            _RPC_BASE_LOCK,
            engine_processes.environment({"VLLM_RPC_BASE_PATH": ipc, "VLLM_WORKER_MULTIPROC_METHOD": spawn}),
        ):
            self._start_engines_here()

    def _start_engines_here(self) -> None:
        """Start every engine, in the environment _start_engines set."""
        from concurrent.futures import ThreadPoolExecutor

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        def start(role: str) -> Any:
            args = AsyncEngineArgs(**self.engine_kwargs(role))
            if not self.from_forkserver:
                return AsyncLLM.from_engine_args(args)
            with engine_start.engine_start(self._engine_variables(role), self._core_pids):
                return AsyncLLM.from_engine_args(args)

        with ThreadPoolExecutor(len(self.models), thread_name_prefix="dual-sampling-start") as pool:
            futures = {}
            for role in self.models:
                if self.from_forkserver:  # each engine's variables travel with it: both start at once
                    futures[role] = pool.submit(start, role)
                    continue
                with engine_processes.environment(self._engine_variables(role)):
                    known = engine_processes.spawned_children()
                    futures[role] = pool.submit(start, role)
                    # The environment is read when the engine's first process is spawned: keep it until then.
                    if self.binding or self.places:
                        engine_processes.await_new_child(known, futures[role])
            errors = [_result_into(self.engines, role, futures.pop(role)) for role in self.models]
        # Nothing in this frame refers to an engine any more: a lingering frame cannot keep one alive past close().
        for error in errors:
            if error is not None:
                raise error

    # ------------------------------------------------------------------ verification

    def verify(self) -> None:
        """Read every engine's effective settings and refuse any that would break lockstep, naming it."""
        from processors import FollowerScheduler, LeaderScheduler
        from processors.model_runner import runner_problem

        problems = []
        cfgs = {role: engine.vllm_config for role, engine in self.engines.items()}
        for role, vc in cfgs.items():
            sc, pc = vc.scheduler_config, vc.parallel_config
            want = LeaderScheduler if role == self.roster.names[0] else FollowerScheduler
            if sc.get_scheduler_cls() is not want:
                problems.append(f"{role}: scheduler_cls is {sc.get_scheduler_cls().__name__}, not {want.__name__}")
            problems += [f"{role}: {problem}" for problem in worker_problems(vc)]
            if sc.async_scheduling:
                problems.append(f"{role}: async_scheduling is on (a step would be scheduled before its tokens exist)")
            if sc.enable_chunked_prefill or (sc.long_prefill_token_threshold or 0) > 0:
                problems.append(f"{role}: chunked prefill is on (partial prefills would be sampled and discarded)")
            if sc.max_num_batched_tokens < vc.model_config.max_model_len:
                problems.append(
                    f"{role}: max_num_batched_tokens={sc.max_num_batched_tokens} is below "
                    f"max_model_len={vc.model_config.max_model_len}"
                )
            for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
                if getattr(pc, name) != 1:
                    problems.append(
                        f"{role}: {name}={getattr(pc, name)}; only 1 is supported (every rank would "
                        "run the processors and race to publish the token)"
                    )
            if vc.speculative_config is not None:
                problems.append(f"{role}: speculative decoding is on (tokens would be proposed outside the mixture)")
            if problem := runner_problem(vc):
                problems.append(f"{role}: {problem}")
            if str(sc.policy) not in ("fcfs", "SchedulingPolicy.FCFS"):
                problems.append(f"{role}: scheduling_policy is {sc.policy}, not fcfs")
            problems += self._kv_problems(role, vc)
        for name, get in (
            ("max_num_seqs", lambda vc: vc.scheduler_config.max_num_seqs),
            ("max_model_len", lambda vc: vc.model_config.max_model_len),
            ("max_num_batched_tokens", lambda vc: vc.scheduler_config.max_num_batched_tokens),
        ):
            values = {role: get(vc) for role, vc in cfgs.items()}
            if len(set(values.values())) > 1:
                problems.append(f"{name} differs between the engines ({values})")
        if problems:
            raise ValueError("the engines' settings would break lockstep: " + "; ".join(problems))

    def _kv_problems(self, role: str, vc: Any) -> list[str]:
        cache = vc.cache_config
        blocks, block_size = getattr(cache, "num_gpu_blocks", None), cache.block_size
        if not blocks:
            return []
        per_request = math.ceil(vc.model_config.max_model_len / block_size)
        need = vc.scheduler_config.max_num_seqs * per_request + 1  # +1: vLLM's null block is never handed out
        if blocks >= need:
            return []
        model = self.models[role]
        dtype = placement.engine_dtype(self.config, model)
        want = kv_cache_bytes_needed(
            model.folder, vc.scheduler_config.max_num_seqs, vc.model_config.max_model_len, dtype, block_size
        )
        return [
            f"{role}: the KV cache has {blocks} blocks of {block_size} tokens, fewer than the {need} that "
            f"max_num_seqs x max_model_len need (about {want / _MiB:.0f} MiB); an engine short of KV would "
            "preempt requests. Raise kv_cache_memory_bytes or lower max_num_seqs / max_model_len"
        ]

    # ------------------------------------------------------------------ processes

    def _core_processes(self) -> dict[str, list]:
        procs = {}
        for role, engine in self.engines.items():
            manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
            procs[role] = list(getattr(manager, "processes", []))
        return procs

    def pids(self) -> dict[str, list[int]]:
        """Process ids of each engine: its EngineCore first, then the workers it started."""
        return {
            role: engine_processes.descendants([p.pid for p in procs]) for role, procs in self._core_processes().items()
        }

    def _all_pids(self) -> list[int]:
        return [pid for role_pids in self.pids().values() for pid in role_pids]

    def worker_cpu_seconds(self) -> float:
        """CPU seconds (user + system) used so far by the engines' processes other than the EngineCores.

        Those are the processes that run the models: their CPU time keeps growing through a
        long step (a prefill of many long prompts can take minutes on a CPU) and stops when
        an engine hangs or waits.
        """
        import psutil

        total = 0.0
        for role_pids in self.pids().values():
            for pid in role_pids[1:]:
                with contextlib.suppress(psutil.Error):
                    times = psutil.Process(pid).cpu_times()
                    total += times.user + times.system
        return total

    def dead(self) -> str | None:
        """The role of an engine whose EngineCore process has exited, if any."""
        for role, procs in self._core_processes().items():
            if any(not p.is_alive() for p in procs):
                return role
        return None

    def _list_while_starting(self, children_before: set[int], started: threading.Event) -> None:
        """Until ``started`` is set, keep the listing up to date with the files of the processes being started."""
        while not started.wait(_LISTING_INTERVAL_S):
            try:
                # From the fork server, this pair's EngineCores are known by pid (the server's other children belong
                # to other pairs); spawned, they are this process's new children.
                roots = list(self._core_pids) if self.from_forkserver else engine_processes.children() - children_before
                self._record_segments(engine_processes.descendants(roots))
            except Exception:  # a process that exits mid-read; the next round or the final record covers it
                logger.debug("listing the starting engines' files failed", exc_info=True)

    def _record_segments(self, pids: list[int]) -> None:
        """Note the /dev/shm files mapped by the engine processes ``pids``, so a crash of this driver cannot leak them.

        Those the engines map, and (in the listing only) the multiprocessing semaphores that
        appeared while they started. A semaphore's creator unlinks it on a clean exit and
        Python's resource tracker after a crash, but a cluster manager may kill the tracker along
        with a dead driver (Ray does). A listed name is removed only once this driver is dead and
        no live process maps it; removing a semaphore's name never affects handles already open.
        """
        self._segments |= engine_processes.engine_shm_files(pids)
        names = self._segments | (engine_processes.semaphore_files() - self._semaphores_before)
        if names != self._listed:
            write_listing(segments_listing(self.session_name), names)
            self._listed = names

    def close(self) -> None:
        """Stop every engine; afterwards none of their processes and none of their /dev/shm files remain.

        Also after a failed start: what the engines listed while starting is removed.
        """
        pids = []
        with contextlib.suppress(Exception):
            pids = self._all_pids()
            self._segments |= engine_processes.engine_shm_files(pids)
        engines = list(self.engines.items())
        self.engines.clear()
        # vLLM stops an engine in up to 5 s (SIGTERM, then SIGKILL); both at once halves the wait.
        threads = [threading.Thread(target=_shutdown, args=(role, engine), daemon=True) for role, engine in engines]
        del engines
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=_EXIT_WAIT_S + 5)
        engine_processes.reap(pids, _EXIT_WAIT_S)
        for name in self._segments:
            engine_processes.remove_engine_file(name)
        segments_listing(self.session_name).unlink(missing_ok=True)
        if self.ipc_dir is not None:  # vLLM leaves its ipc:// socket files behind; they are ours to remove
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def qualified_name(cls: type) -> str:
    """The dotted path vLLM resolves a class setting from (``module.Class``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _shutdown(role: str, engine: Any) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.exception("shutting down the %s engine failed; its processes are killed instead", role)


def _result_into(engines: dict, role: str, future: Any) -> BaseException | None:
    """Store a start's engine under ``role``, or return the exception it raised."""
    try:
        engines[role] = future.result()
        return None
    except BaseException as exc:
        return exc


_RPC_BASE_LOCK = threading.Lock()
"""One pair of this process starts at a time: VLLM_RPC_BASE_PATH is process-wide while it is set."""


def _resolve_row_transport(requested: str, places: dict[str, placement.EnginePlace], followers: int = 1) -> str:
    """The ``row_transport`` for engines on vLLM's platform here, placed at ``places``, with ``followers`` following
    engines: the device transport needs a pair on one GPU (engines not placed see the same GPUs and take the same
    one)."""
    from vllm.platforms import current_platform

    devices = {place.visible_devices for place in places.values()}
    return resolve_transport(requested, current_platform.device_type, len(devices) <= 1, followers)


def worker_problems(vc: Any) -> list[str]:
    """What in an engine's effective settings ``vc`` (a ``VllmConfig``) keeps the driver from reaching its workers:
    another worker extension (weight and alpha updates, the speculative step go through ours) or weight-transfer
    engine (a state dict's update goes through ours)."""
    from processors import DualSamplingWorkerExtension
    from processors.weight_transfer import ENGINE_NAME

    problems = []
    extension = vc.parallel_config.worker_extension_cls
    if extension != qualified_name(DualSamplingWorkerExtension):
        problems.append(f"worker_extension_cls is {extension!r}, not {qualified_name(DualSamplingWorkerExtension)!r}")
    transfer = vc.weight_transfer_config
    if transfer is None or transfer.backend != ENGINE_NAME:
        backend = transfer.backend if transfer is not None else None
        problems.append(f"weight_transfer_config's backend is {backend!r}, not {ENGINE_NAME!r}")
    return problems


def start_lockstep(config: DualEngineConfig, tokenizer: Any, engine_len: int, **settings: Any) -> LockstepDriver:
    """``mode="lockstep"`` (``dual_sampling.modes``): an engine per model of the config's roster (a teacher and a
    theta engine, or several teachers and theta's), of ``engine_len`` positions."""
    return LockstepDriver(
        lambda session_name: EnginePair(config, session_name, engine_len), tokenizer, roster=config.roster, **settings
    )
