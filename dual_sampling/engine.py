"""OptimalSamplingDual: two vLLM engines in lockstep, sampling from the geometric mixture.

The driver owns one shared-memory session (``dual_sampling.sync``) and two ``vllm.LLM``
engines, each in its own engine process with its own logits processor
(``processors.TeacherSyncLogitsProcessor`` / ``ThetaSyncLogitsProcessor``). One thread per
engine owns that engine: it adds requests, steps it, and reports finished outputs. The main
thread admits request pairs to both engines in the same order, at most one per free slot,
collects both sides' outputs, checks that they agree, and reads the per-token records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from alpha import get_alpha_computer
from dual_sampling.outputs import DualGenerationOutput, RequestRecord, SampleRecord
from dual_sampling.sampling import RowSampling
from dual_sampling.sync import (
    ERR_NONE, ERROR, ERROR_NAMES, ERROR_STEP, NUM_RECORDS, TEACHER_FINISHED, THETA_FINISHED, SessionLayout, SyncError,
    SyncSession,
)
from dual_sampling.vocab import check_tokenizers_match

__all__ = ["OptimalSamplingDual", "DualEngineConfig", "kv_cache_bytes_needed", "default_kv_cache_bytes", "split_cpu_binding",
           "engine_cpus"]

_MiB = 1 << 20
_DELIVERY_S = 0.01
"""Time for requests sent to an engine to reach its input queue before the gate opens (a few socket hops)."""
_ADMIT_LIMIT_S = 10.0
"""Longest the driver waits for the engines during one admission (it then admits unaligned)."""
_BEST_OF_SCORES = ("logq", "logp_theta", "logp_teacher")


@dataclass
class DualEngineConfig:
    """Everything fixed for the life of a dual engine. Validated at construction."""

    model_teacher: str
    """Path of the teacher model (a local Hugging Face folder)."""
    model_theta: str
    """Path of the theta (student) model; must share the teacher's tokenizer."""
    alpha_method: str = "kl_symmetry"
    """Registered alpha method: fixed, kl_symmetry, ess_balance, entropy, or a plugin's."""
    alpha_min: float = 0.0
    """Lower clamp on the teacher weight α."""
    alpha_max: float = 1.0
    """Upper clamp on the teacher weight α."""
    alpha_config: dict[str, Any] = field(default_factory=dict)
    """Further fields of the alpha method (for example ``{"alpha": 0.3}`` for fixed)."""
    sync_timeout: float = 60.0
    """Seconds a processor waits for its partner's row before failing that request."""
    max_num_seqs: int = 8
    """Requests each engine runs at once (equal on both sides: lockstep relies on it)."""
    max_model_len: int | None = None
    """Prompt plus generated tokens per request; None: min(model limit, 2048)."""
    dtype: str = "float32"
    """Model dtype; float32 is about 2x faster than bfloat16 on CPUs without bf16."""
    kv_cache_memory_bytes: int | None = None
    """KV cache per engine; None sizes it for max_num_seqs x max_model_len, so nothing is preempted."""
    enforce_eager: bool = True
    """Skip graph compilation (engine start in seconds rather than minutes)."""
    enable_prefix_caching: bool = True
    """Share the KV of common prompt prefixes (the n samples of one prompt)."""
    cpu_binding: str = "split"
    """CPU backend only. "split": each engine's model gets its own half of the CPUs, so both run at once; "vllm": vLLM's own binding (both models on the same cores)."""
    teacher_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` arguments for the teacher engine; they override the above."""
    theta_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` arguments for the theta engine."""
    use_tqdm: bool = True
    """Show a progress bar over requests."""

    def __post_init__(self) -> None:
        for role in ("model_teacher", "model_theta"):
            path = Path(str(getattr(self, role)))
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{role}={str(path)!r} is not a local model folder (no config.json)")
        # Building the computer validates the method name and its bounds, naming the bad value.
        get_alpha_computer(self.alpha_method, alpha_min=self.alpha_min, alpha_max=self.alpha_max, **self.alpha_config)
        if not (isinstance(self.sync_timeout, (int, float)) and self.sync_timeout > 0 and math.isfinite(self.sync_timeout)):
            raise ValueError(f"sync_timeout must be a positive number of seconds, got {self.sync_timeout!r}")
        if not (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1):
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if self.cpu_binding not in ("split", "vllm"):
            raise ValueError(f"cpu_binding must be 'split' or 'vllm', got {self.cpu_binding!r}")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")


def _model_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def kv_cache_bytes_needed(model_path: str, max_num_seqs: int, max_model_len: int, dtype: str = "float32") -> int:
    """Bytes of KV cache that hold ``max_num_seqs`` full contexts of ``max_model_len`` tokens."""
    cfg = _model_config(model_path)
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    size = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(dtype, 4)
    return max_num_seqs * max_model_len * 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size


def default_kv_cache_bytes(model_path: str, max_num_seqs: int, max_model_len: int, dtype: str = "float32") -> int:
    """The cache an engine gets when none is given: the need plus 10 % and 16 MiB for block rounding."""
    return int(kv_cache_bytes_needed(model_path, max_num_seqs, max_model_len, dtype) * 1.1) + 16 * _MiB


def _derive_seed(seed: int, prompt_key: int | str, sample_index: int) -> int:
    """A distinct, reproducible 63-bit seed per sample of a prompt."""
    digest = hashlib.blake2b(f"{seed}/{prompt_key}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _EngineThread(threading.Thread):
    """Owns one LLMEngine: adds requests from its inbox (``add_request`` argument tuples), steps, reports finished outputs.

    It never blocks inside ``step()`` waiting for output: while the engine is parked at the
    admission gate no output comes, and the thread must still be free to add requests.
    """

    def __init__(self, side: str, llm, results: "queue.Queue") -> None:
        super().__init__(name=f"dual-sampling-{side}", daemon=True)
        self.side, self.engine, self.results = side, llm.llm_engine, results
        self.inbox: "queue.Queue" = queue.Queue()
        self.added = 0
        """Requests handed to the engine so far (the driver waits on it during admission)."""
        self.stop_flag = threading.Event()
        # The multiprocess client queues each engine step's output; step() blocks until there is one.
        self._outputs = getattr(self.engine.engine_core, "outputs_queue", None)

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                busy = self.engine.has_unfinished_requests()
                if busy and (self._outputs is None or not self._outputs.empty()):
                    for out in self.engine.step():
                        if out.finished:
                            self.results.put((self.side, out))
                    self._add_waiting()
                else:
                    self._add_waiting(timeout=0.002 if busy else 0.05)
        except BaseException as exc:  # reported to the driver, which fails the run loudly
            self.results.put((self.side, exc))

    def _add_waiting(self, timeout: float = 0.0) -> None:
        try:
            item = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self.engine.add_request(*item)
            self.added += 1
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return


@dataclass
class _Work:
    prompt_index: int
    sample_index: int
    key: int
    seed: int
    teacher_ids: list[int]
    theta_ids: list[int]
    max_tokens: int
    slot: int = -1
    outputs: dict = field(default_factory=dict)


class OptimalSamplingDual:
    """Generate from q ∝ π_θ^(1−α)·π_t^α with a teacher and a theta engine in lockstep.

    Use as a context manager (or call :meth:`close`) so the engines stop and the shared
    memory is removed. See :class:`DualEngineConfig` for the arguments.
    """

    def __init__(self, model_teacher: str, model_theta: str, **settings: Any) -> None:
        self.config = DualEngineConfig(str(model_teacher), str(model_theta), **settings)
        cfg = self.config
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_teacher)
        check_tokenizers_match(self.tokenizer, AutoTokenizer.from_pretrained(cfg.model_theta))
        self.vocab = len(self.tokenizer)
        t_cfg, th_cfg = _model_config(cfg.model_teacher), _model_config(cfg.model_theta)
        for role, mc in (("teacher", t_cfg), ("theta", th_cfg)):
            if mc.get("vocab_size", self.vocab) < self.vocab:
                raise ValueError(f"the {role} model has {mc['vocab_size']} embedding rows, fewer than the tokenizer's {self.vocab} tokens")
        limit = min(t_cfg.get("max_position_embeddings", 2048), th_cfg.get("max_position_embeddings", 2048))
        self.max_model_len = cfg.max_model_len or min(limit, 2048)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the models' limit of {limit} positions")
        self.eos_token_ids = sorted({i for mc in (t_cfg, th_cfg) for i in _as_list(mc.get("eos_token_id"))}
                                    | set(_as_list(self.tokenizer.eos_token_id)))
        if not self.eos_token_ids:
            raise ValueError("neither model nor the tokenizer defines an EOS token id")
        self._kv_bytes = {}
        for role, path in (("teacher", cfg.model_teacher), ("theta", cfg.model_theta)):
            need = kv_cache_bytes_needed(path, cfg.max_num_seqs, self.max_model_len, cfg.dtype)
            given = cfg.kv_cache_memory_bytes
            if given is not None and given < need:
                raise ValueError(
                    f"kv_cache_memory_bytes={given} is too small for the {role}: max_num_seqs x max_model_len = "
                    f"{cfg.max_num_seqs} x {self.max_model_len} tokens need {need} bytes. A smaller cache would let "
                    "one engine preempt requests and break lockstep; raise it or lower max_num_seqs/max_model_len."
                )
            self._kv_bytes[role] = given if given is not None else default_kv_cache_bytes(path, cfg.max_num_seqs, self.max_model_len, cfg.dtype)

        self.session = SyncSession.create(SessionLayout(self.vocab, 2 * cfg.max_num_seqs + 2, self.max_model_len))
        self._llms: dict[str, Any] = {}
        self._binding: dict[str, str] = {}
        self._closed = False
        self._next_key = 1
        try:
            self._start_engines()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ engines

    def _engine_kwargs(self, role: str) -> dict[str, Any]:
        cfg = self.config
        from processors import TeacherSyncLogitsProcessor, ThetaSyncLogitsProcessor

        kwargs = dict(
            model=cfg.model_teacher if role == "teacher" else cfg.model_theta,
            tokenizer=cfg.model_teacher,
            dtype=cfg.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            # Chunked prefill would hand the processors logits rows that vLLM then discards;
            # with it off and a token budget of a whole context, the scheduler waits instead.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(self.max_model_len, 2048),
            # Async scheduling runs a step ahead of the output: lockstep needs each step's tokens first.
            async_scheduling=False,
            kv_cache_memory_bytes=self._kv_bytes[role],
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=0,
            generation_config="vllm",
            logits_processors=[TeacherSyncLogitsProcessor if role == "teacher" else ThetaSyncLogitsProcessor],
            additional_config={"dual_sampling": {
                "role": role,
                "session": self.session.name,
                "sync_timeout": cfg.sync_timeout,
                "abandon_token_id": self.eos_token_ids[0],
                "alpha_method": cfg.alpha_method,
                "alpha_config": {"alpha_min": cfg.alpha_min, "alpha_max": cfg.alpha_max, **cfg.alpha_config},
                # Theta's CPUs idle while the teacher decides; the teacher borrows them (see processors.teacher).
                "mix_helper_cpus": [int(c) for c in self._binding["theta"].split(",")] if role == "teacher" and self._binding else None,
            }},
        )
        kwargs.update(cfg.teacher_engine_kwargs if role == "teacher" else cfg.theta_engine_kwargs)
        return kwargs

    def _start_engines(self) -> None:
        # The V1 logits-processor interface: GPUs default to Model Runner V2, which has another one.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM

        self._binding = split_cpu_binding() if self.config.cpu_binding == "split" else {}
        for role in ("teacher", "theta"):
            with engine_cpus(self._binding.get(role)):
                self._llms[role] = LLM(**self._engine_kwargs(role))
            cache = self._llms[role].llm_engine.vllm_config.cache_config
            blocks = getattr(cache, "num_gpu_blocks", None)
            if blocks:
                capacity = blocks * cache.block_size
                if capacity < self.config.max_num_seqs * self.max_model_len:
                    raise ValueError(
                        f"the {role} engine's KV cache holds {capacity} tokens, less than max_num_seqs x max_model_len = "
                        f"{self.config.max_num_seqs * self.max_model_len}; preemption would break lockstep"
                    )

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        teacher_prompts: Sequence[str | Sequence[int]] | None = None,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        n: int = 1,
        seed: int = 0,
        *,
        min_p: float = 0.0,
        min_tokens: int = 0,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        best_of: int | None = None,
        best_of_score: str = "logq",
        logit_bias: dict[int, float] | None = None,
        force_first_token: bool = False,
        teacher_support_top_k: int = -1,
        teacher_support_top_p: float = 1.0,
        prompt_keys: Sequence[str] | None = None,
        use_tqdm: bool | None = None,
        **unsupported: Any,
    ) -> DualGenerationOutput:
        """Generate ``n`` samples per prompt. Prompts are text or token ids.

        ``teacher_prompts`` (same length) lets the teacher see a different prompt from theta's,
        for example with a reference solution as a hint. ``best_of`` ≥ n draws that many and
        keeps the n with the highest summed ``best_of_score`` (logq, logp_theta, logp_teacher).
        Sample j of prompt i is drawn with a seed derived from (seed, i, j); ``prompt_keys``
        (stable ids, one per prompt) replace i, so a sample's seed does not depend on which
        other prompts share the call (data-generation runs rely on this to resume).
        """
        if self._closed:
            raise RuntimeError("this OptimalSamplingDual is closed")
        if unsupported:
            raise ValueError(
                f"unsupported sampling options: {', '.join(sorted(unsupported))}. Penalties and bad words would act "
                "after the token is forced; supported: temperature, top_p, top_k, min_p, min_tokens, logit_bias, "
                "stop, stop_token_ids, n, best_of, force_first_token, teacher_support_top_k/top_p"
            )
        _check_sampling(max_tokens, temperature, top_p, top_k, n, min_p, min_tokens, best_of, best_of_score,
                        teacher_support_top_k, teacher_support_top_p, logit_bias, self.vocab)
        theta_ids = [self._tokenize(p, i, "prompts") for i, p in enumerate(prompts)]
        if teacher_prompts is None:
            teacher_ids = theta_ids
        else:
            if len(teacher_prompts) != len(prompts):
                raise ValueError(f"teacher_prompts has {len(teacher_prompts)} entries but prompts has {len(prompts)}")
            teacher_ids = [self._tokenize(p, i, "teacher_prompts") for i, p in enumerate(teacher_prompts)]
        stops = sorted(set(self.eos_token_ids) | set(stop_token_ids or ()))
        if prompt_keys is not None and len(prompt_keys) != len(prompts):
            raise ValueError(f"prompt_keys has {len(prompt_keys)} entries but prompts has {len(prompts)}")
        keys = list(prompt_keys) if prompt_keys is not None else list(range(len(prompts)))
        draws = best_of or n
        work: list[_Work] = []
        for i, (t_ids, th_ids) in enumerate(zip(teacher_ids, theta_ids)):
            room = self.max_model_len - max(len(t_ids), len(th_ids))
            if room < 1:
                raise ValueError(f"prompt {i} has {max(len(t_ids), len(th_ids))} tokens, no room left in max_model_len={self.max_model_len}")
            for j in range(draws):
                work.append(_Work(i, j, self._take_key(), _derive_seed(seed, keys[i], j), t_ids, th_ids, min(max_tokens, room)))
        base_sampling = RowSampling(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
                                    min_tokens=int(min_tokens), stop_token_ids=tuple(stops), logit_bias=dict(logit_bias or {}),
                                    force_first_token=bool(force_first_token), support_top_k=int(teacher_support_top_k),
                                    support_top_p=float(teacher_support_top_p))
        show = self.config.use_tqdm if use_tqdm is None else use_tqdm
        samples = self._run(work, base_sampling, list(stop or ()), show)
        by_prompt: list[list[SampleRecord]] = [[] for _ in prompts]
        for w in work:
            by_prompt[w.prompt_index].append(samples[w.key])
        requests = []
        for i, (t_ids, th_ids, mine) in enumerate(zip(teacher_ids, theta_ids, by_prompt)):
            if best_of:
                mine = sorted(mine, key=lambda s: -_score(s, best_of_score))[:n]
            requests.append(RequestRecord(i, list(t_ids), list(th_ids), mine))
        return DualGenerationOutput(requests)

    def _engine_processes(self) -> dict[str, list]:
        procs = {}
        for role, llm in self._llms.items():
            manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
            procs[role] = list(getattr(manager, "processes", []))
        return procs

    def engine_pids(self) -> dict[str, list[int]]:
        """Process ids of each engine's core process(es), by role (for monitoring and fault tests)."""
        return {role: [p.pid for p in procs] for role, procs in self._engine_processes().items()}

    def _rows_served(self) -> tuple[int, int]:
        stats = self.session.statistics()
        return stats["teacher_rows"], stats["theta_rows"]

    def _dead_engine(self) -> str | None:
        """The role of an engine whose core process has exited, if any."""
        for role, procs in self._engine_processes().items():
            if any(not p.is_alive() for p in procs):
                return role
        return None

    def get_sync_statistics(self) -> dict[str, float]:
        """Counters from both processors: rows served, wait and mixing time, abandoned rows, timeouts."""
        stats: dict[str, float] = dict(self.session.statistics())
        for key in ("teacher_wait_ns", "theta_wait_ns", "mix_ns", "teacher_parked_ns"):
            stats[key.replace("_ns", "_s")] = stats.pop(key) / 1e9
        return stats

    def close(self) -> None:
        """Stop both engines and remove the shared memory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.session.shutdown()
        for llm in self._llms.values():
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        self._llms.clear()
        self.session.close()

    def __enter__(self) -> "OptimalSamplingDual":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ internals

    def _take_key(self) -> int:
        key, self._next_key = self._next_key, self._next_key + 1
        return key

    def _tokenize(self, prompt: str | Sequence[int], index: int, name: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"{name}[{index}] has token ids outside the vocabulary [0, {self.vocab}): {bad[:5]}")
        if not ids:
            raise ValueError(f"{name}[{index}] is empty")
        return ids

    def _run(self, work: list[_Work], sampling: RowSampling, stop: list[str], show: bool) -> dict[int, SampleRecord]:
        from tqdm.auto import tqdm
        from vllm import SamplingParams

        results: "queue.Queue" = queue.Queue()
        threads = {role: _EngineThread(role, llm, results) for role, llm in self._llms.items()}
        for t in threads.values():
            t.start()
        session, layout = self.session, self.session.layout
        free = [s for s in range(layout.slots) if session.slot_free(s)]
        todo = list(reversed(work))
        in_flight: dict[str, _Work] = {}
        done: dict[int, SampleRecord] = {}
        bar = tqdm(total=len(work), desc="dual sampling", unit="seq", disable=not show)
        # Progress is a row served by either processor: a long generation finishes nothing for minutes.
        last_progress, last_served = time.monotonic(), self._rows_served()
        engine_failed = False
        try:
            while todo or in_flight:
                if not free:
                    free = [s for s in range(layout.slots) if session.slot_free(s)]
                admit = []
                while todo and free:
                    w = todo.pop()
                    w.slot = free.pop()
                    session.open_slot(w.slot, w.key)
                    row = dataclasses.replace(sampling, seed=w.seed)
                    params = SamplingParams(
                        n=1, temperature=0.0, max_tokens=w.max_tokens, min_tokens=0, stop=stop or None,
                        stop_token_ids=list(sampling.stop_token_ids), skip_special_tokens=True,
                        extra_args={"dual_sampling": {"slot": w.slot, "key": w.key, "sampling": row.to_dict()}},
                    )
                    admit.append((f"k{w.key}", w, params))
                if admit:
                    idle = not in_flight
                    in_flight.update((rid, w) for rid, w, _ in admit)
                    self._admit(threads, admit, idle)
                if todo and not in_flight and not free:
                    raise SyncError("no shared-memory slot was released although no request is in flight")
                try:
                    side, out = results.get(timeout=0.2)
                except queue.Empty:
                    dead = self._dead_engine()
                    if dead:
                        engine_failed = True
                        raise SyncError(f"the {dead} engine failed: its engine process exited") from None
                    served = self._rows_served()
                    if served != last_served:
                        last_served, last_progress = served, time.monotonic()
                    elif time.monotonic() - last_progress > self.config.sync_timeout + 30:
                        raise SyncError(f"neither engine served a row for {self.config.sync_timeout + 30:.0f} s "
                                        f"({len(in_flight)} requests in flight); an engine stopped responding") from None
                    continue
                last_progress = time.monotonic()
                if isinstance(out, BaseException):
                    engine_failed = True
                    raise SyncError(f"the {side} engine failed: {type(out).__name__}: {out}".rstrip(": ")) from out
                w = in_flight[out.request_id]
                w.outputs[side] = out
                session.mark_finished(w.slot, TEACHER_FINISHED if side == "teacher" else THETA_FINISHED)
                if len(w.outputs) == 2:
                    done[w.key] = self._collect(w)
                    del in_flight[out.request_id]
                    bar.update(1)
        except BaseException:
            session.shutdown()
            raise
        finally:
            for t in threads.values():
                t.stop_flag.set()
            for t in threads.values():
                t.join(timeout=10)
            bar.close()
            if engine_failed:
                # A dead engine cannot be restarted in place: stop the other one and free the shared memory.
                self.close()
        return done

    def _admit(self, threads: dict[str, _EngineThread], items: list, idle: bool) -> None:
        """Hand requests to both engines so that both take them in at the same engine step.

        The admission gate (``dual_sampling.sync``) parks both processors at the end of a
        step while the requests travel; an idle engine instead starts a step the moment its
        first request arrives, so exactly one request goes first and the rest wait for the gate.
        Alignment affects speed only: if a side does not park in time, admission goes ahead.
        """
        session = self.session
        generation = session.hold_gate()
        try:
            if idle:
                self._send(threads, items[:1])
                items = items[1:]
            if not items:
                return
            self._await_parked(threads, generation)
            self._send(threads, items)
            time.sleep(_DELIVERY_S)
        finally:
            session.open_gate(generation)

    @staticmethod
    def _send(threads: dict[str, _EngineThread], items: list) -> None:
        """Put ``items`` in both engines' inboxes and wait until both engine threads have added them."""
        targets = {}
        for role, thread in threads.items():
            targets[role] = thread.added + len(items)
            for rid, w, params in items:
                thread.inbox.put((rid, {"prompt_token_ids": w.teacher_ids if role == "teacher" else w.theta_ids}, params))
        deadline = time.monotonic() + _ADMIT_LIMIT_S
        while any(t.added < targets[r] and t.is_alive() for r, t in threads.items()) and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _await_parked(self, threads: dict[str, _EngineThread], generation: int) -> None:
        """Wait until each engine is parked at the gate or has nothing to run (it cannot park then)."""
        deadline = time.monotonic() + _ADMIT_LIMIT_S
        while time.monotonic() < deadline:
            parked = dict(zip(("teacher", "theta"), self.session.parked(generation)))
            if all(parked[r] or not t.engine.has_unfinished_requests() or not t.is_alive() for r, t in threads.items()):
                return
            time.sleep(0.0005)

    def _collect(self, w: _Work) -> SampleRecord:
        s = self.session
        teacher_out, theta_out = w.outputs["teacher"].outputs[0], w.outputs["theta"].outputs[0]
        t_ids, th_ids = list(teacher_out.token_ids), list(theta_out.token_ids)
        control = s.control[w.slot]
        error_code, error_step, n_rec = int(control[ERROR]), int(control[ERROR_STEP]), int(control[NUM_RECORDS])
        records = s.records[w.slot, : len(t_ids)].copy()
        recorded_ids = s.tokens[w.slot, : len(t_ids)].tolist()
        s.close_slot(w.slot)
        sample = SampleRecord(text=teacher_out.text, token_ids=t_ids, finish_reason=teacher_out.finish_reason, seed=w.seed,
                              teacher_token_ids=t_ids, theta_token_ids=th_ids)
        if error_code != ERR_NONE:
            sample.finish_reason = "sync_error"
            sample.error = f"{ERROR_NAMES.get(error_code, error_code)} at step {error_step}"
            return sample
        if t_ids != th_ids or recorded_ids != t_ids or n_rec < len(t_ids):
            raise SyncError(
                f"request {w.prompt_index} sample {w.sample_index}: the engines' token streams differ "
                f"(teacher {len(t_ids)} tokens, theta {len(th_ids)}, decided {n_rec}); refusing to emit unverified data"
            )
        sample.alpha, sample.logp_teacher, sample.logp_theta, sample.logq = (records[:, k].tolist() for k in range(4))
        return sample


def split_cpu_binding() -> dict[str, str]:
    """{role: CPU list} for vLLM's CPU backend: the teacher's model threads get the first half of the CPUs, theta's the rest.

    vLLM binds every engine's model threads to the same cores of NUMA node 0 and leaves
    one core to its scheduler process; two engines would then time-share those cores
    while the others idle. Empty (vLLM's own binding applies) when not on the CPU backend,
    when the user set VLLM_CPU_OMP_THREADS_BIND, or with fewer than two CPUs.
    """
    from vllm.platforms import current_platform

    cpus = sorted(os.sched_getaffinity(0))
    if not current_platform.is_cpu() or len(cpus) < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    half = (len(cpus) + 1) // 2
    return {"teacher": ",".join(map(str, cpus[:half])), "theta": ",".join(map(str, cpus[half:]))}


@contextlib.contextmanager
def engine_cpus(cpu_list: str | None):
    """Build a vLLM engine inside this block to bind its model threads to ``cpu_list`` ("0,1"; None: vLLM's choice).

    The engine's processes read VLLM_CPU_OMP_THREADS_BIND when they are spawned.
    """
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    try:
        if cpu_list is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _score(sample: SampleRecord, name: str) -> float:
    values = {"logq": sample.logq, "logp_theta": sample.logp_theta, "logp_teacher": sample.logp_teacher}[name]
    return math.fsum(values) if sample.error is None else -math.inf


def _check_sampling(max_tokens, temperature, top_p, top_k, n, min_p, min_tokens, best_of, best_of_score,
                    support_top_k, support_top_p, logit_bias, vocab) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    need(isinstance(max_tokens, int) and max_tokens >= 1, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    need(isinstance(temperature, (int, float)) and temperature >= 0, f"temperature must be >= 0, got {temperature!r}")
    need(isinstance(top_p, (int, float)) and 0 < top_p <= 1, f"top_p must lie in (0, 1], got {top_p!r}")
    need(isinstance(top_k, int) and (top_k == -1 or top_k >= 1), f"top_k must be -1 (off) or >= 1, got {top_k!r}")
    need(isinstance(min_p, (int, float)) and 0 <= min_p <= 1, f"min_p must lie in [0, 1], got {min_p!r}")
    need(isinstance(n, int) and n >= 1, f"n must be an integer >= 1, got {n!r}")
    need(isinstance(min_tokens, int) and 0 <= min_tokens <= max_tokens,
         f"min_tokens must be an integer in [0, max_tokens], got {min_tokens!r}")
    need(best_of is None or (isinstance(best_of, int) and best_of >= n), f"best_of must be >= n={n}, got {best_of!r}")
    need(best_of_score in _BEST_OF_SCORES, f"best_of_score must be one of {_BEST_OF_SCORES}, got {best_of_score!r}")
    need(isinstance(support_top_k, int) and (support_top_k == -1 or support_top_k >= 1),
         f"teacher_support_top_k must be -1 (off) or >= 1, got {support_top_k!r}")
    need(isinstance(support_top_p, (int, float)) and 0 < support_top_p <= 1,
         f"teacher_support_top_p must lie in (0, 1], got {support_top_p!r}")
    for token, bias in (logit_bias or {}).items():
        need(isinstance(token, int) and 0 <= token < vocab, f"logit_bias token {token!r} is outside [0, {vocab})")
        need(isinstance(bias, (int, float)) and math.isfinite(bias), f"logit_bias for token {token} must be finite, got {bias!r}")
