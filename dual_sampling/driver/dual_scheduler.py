"""The long-lived lockstep scheduler on the driver side: two engines, requests accepted at any time.

:class:`DualScheduler` owns one shared-memory session and one :class:`EnginePair`, on an
asyncio loop of its own (a background thread), so it serves blocking callers
(``OptimalSamplingDual.generate``), asyncio callers on other loops (the server) and Ray
actors alike. Per sample it:

1. waits for a free slot, first come first served (the slot count bounds what is
   submitted to the engines; the engines' schedulers decide what runs);
2. opens the slot and submits the two prompts to the two engines;
3. streams the teacher engine's tokens with their records (:class:`SampleDelta`);
4. when both engines have ended the request, checks that both produced the same tokens
   that were decided, reads why it ended, and returns the verified :class:`SampleRecord`.

:meth:`DualScheduler.abort` ends one request on both engines at the next step boundary
(the teacher engine's scheduler decides it; see ``processors.scheduler``). A request
that fails (a timeout, bad logits, a divergence) fails alone: its sample carries
``finish_reason="error"`` and a named ``error``; nothing raises. An engine that dies (its
process exits, or vLLM declares it dead: ``EngineDeadError``), or a session in which no
engine makes progress for ``sync_timeout + 30`` seconds, fails every request in flight or
queued with :class:`SyncError` and closes the scheduler for good (:attr:`DualScheduler.failure`).

:meth:`DualScheduler.update_weights` gives one engine new weights while both stay in
lockstep: no slot is handed out meanwhile, the requests in flight finish on the old weights
(``mode="wait"``) or end with ``finish_reason="abort"`` and ``stop_reason="weight_update"``
(``mode="abort"``), and only with no request on either engine does the engine load the
weights (vLLM's pause, ``reload_weights`` and ``reset_prefix_cache``, then resume). So every
sample is drawn from one version of each model, and it records which
(:attr:`DualScheduler.versions`).

One module over 500 lines: :class:`DualScheduler` is one object whose slots, flights and loop
every method touches; its helpers are a few lines each.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.lockstep import (
    RECORD_FIELDS,
    ErrorCode,
    Finish,
    Phase,
    SessionLayout,
    Slot,
    SyncError,
    SyncSession,
    Writer,
)
from dual_sampling.records import SampleRecord
from dual_sampling.text import sample_text

__all__ = ["UPDATE_MODES", "DualRequest", "DualScheduler", "SampleDelta", "as_coroutine", "check_update"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

UPDATE_MODES = ("wait", "abort")
"""What a weight update does with the requests in flight: let them finish on the old weights, or abort them."""
_SLOT_POLL_S = 0.005
"""How often a request waiting for a slot looks again (slots free up as the engines release them)."""
_WATCH_S = 0.5
"""How often the engines' processes and progress are checked."""
_STALL_GRACE_S = 30.0
"""Beyond sync_timeout, how long no engine may serve a row nor compute while requests are in flight."""
_COMPUTING_CPU_SHARE = 0.5
"""The engines' model processes count as computing while they use at least this share of one core."""
_ABORT_POLL_S = 0.05
"""How often an abort from another thread, waiting for the scheduler's loop to run it, checks the loop still runs."""


@dataclass
class DualRequest:
    """One sample to draw: both prompts as token ids, and how to draw it."""

    teacher_prompt_ids: list[int]
    theta_prompt_ids: list[int]
    sampling: RowSampling
    """The per-token decision's settings, with this sample's seed and the stop token ids (EOS included)."""
    max_tokens: int
    """Generated tokens at most; must fit in max_model_len after the longer prompt."""
    stop: tuple[str, ...] = ()
    """Stop strings (the teacher scheduler looks for them)."""
    request_id: str | None = None
    """The caller's name for the request, unique among those in flight (for :meth:`DualScheduler.abort`);
    None: one is made up."""


@dataclass
class SampleDelta:
    """New tokens of one sample and their records; the last delta of a sample carries the verified sample."""

    token_ids: list[int]
    records: np.ndarray
    """``[r, 4]`` float32: α, log π_t, log π_θ, log q of the first r of these tokens (r = len(token_ids) unless
    the row failed: a forced token has no record). Provisional until ``sample``."""
    sample: SampleRecord | None = None
    """Set on the last delta only: the whole sample, checked against both engines."""
    top: tuple[np.ndarray, np.ndarray] | None = None
    """For requests with top_logprobs k: (token ids, log q) ``[len(token_ids), k]`` of q's k most likely tokens."""
    dense: tuple[np.ndarray, np.ndarray] | None = None
    """For requests with dense_logprobs k: (token ids, log-probabilities) ``[r, 2, k]``, the teacher's own top k at
    ``[:, 0]`` and theta's at ``[:, 1]`` (see :attr:`SampleRecord.dense_ids`)."""


@dataclass
class _Flight:
    """One request between its submission and the moment both engines have let it go."""

    request_id: str
    slot: int
    key: int
    request: DualRequest
    tokens: list[int] = field(default_factory=list)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Deltas (or the exception that ended the request) for the caller's stream."""
    task: asyncio.Task | None = None
    versions: dict[str, str] = field(default_factory=lambda: {"teacher": "0", "theta": "0"})
    """The weight version of each engine when the request was launched (it cannot change before it ends)."""


class DualScheduler:
    """Two engines in lockstep behind one asyncio API; see the module docstring.

    ``engine_factory(session_name)`` builds the engine pair on the scheduler's loop (the
    real one is :class:`dual_sampling.driver.pair.EnginePair`; tests pass simulated engines).
    """

    def __init__(
        self,
        engine_factory: Callable[[str], Any],
        tokenizer: Any,
        vocab: int,
        max_model_len: int,
        max_num_seqs: int,
        sync_timeout: float,
        slots: int | None = None,
        max_dense_logprobs: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sync_timeout = sync_timeout
        layout = SessionLayout(
            vocab=vocab,
            slots=slots or 2 * max_num_seqs + 2,
            max_steps=max_model_len,
            plan_width=max_num_seqs,
            dense_k=max_dense_logprobs,
        )
        self.session = SyncSession.create(layout)
        self.engines: Any = None
        self.failure: SyncError | None = None
        """Set once, for good, when the scheduler can serve nothing more (an engine died, or it was closed)."""
        self.counters: collections.Counter = collections.Counter(
            {
                name: 0
                for name in [
                    "requests",
                    "tokens",
                    "teacher_updates",
                    "theta_updates",
                    *(f"finished_{r}" for r in ("stop", "length", "abort", "error")),
                    *(f"failed_{c.label}" for c in ErrorCode if c != ErrorCode.NONE),
                ]
            }
        )
        """Requests submitted, finished by reason, failed by error code, tokens generated, and weight updates per
        engine (all keys present)."""
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)
        self._flights: dict[str, _Flight] = {}
        self._queued: dict[str, asyncio.Future] = {}
        """Requests waiting for a slot, by id; an abort resolves the future with None."""
        self._held: set[int] = set()
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._slot_feeder: asyncio.Task | None = None
        self._aborted_before_launch: set[str] = set()
        """Requests aborted after a slot was handed to them but before they reached the engines."""
        self.versions: dict[str, str] = {"teacher": "0", "theta": "0"}
        """Each engine's weight version: "0" as started, then the label of each update (:meth:`update_weights`)."""
        self.labels_used: dict[str, set[str]] = {role: {version} for role, version in self.versions.items()}
        """Every label each role's weights have carried: a relabel to one of them would make two θ look alike."""
        self._updating = False
        """While set, no slot is handed out: an update waits for the engines to run no request."""
        self.paused = False
        """Set by :meth:`pause` until :meth:`resume`: no slot is handed out (requests wait for one)."""
        self._update_aborts: set[str] = set()
        """Requests aborted by an update, so their samples say why."""
        self._closing = False
        self._engines_lock = threading.Lock()
        self._engines_closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dual-sampling-loop", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # an exception or a signal that ends the program still stops the engines
        try:
            self.engines = self.call(self._start(engine_factory))
        except BaseException:
            self.close()
            raise

    async def _start(self, engine_factory: Callable[[str], Any]) -> Any:
        self._update_lock = asyncio.Lock()
        engines = engine_factory(self.session.name)
        self._watch_task = asyncio.create_task(self._watch())
        return engines

    # ------------------------------------------------------------------ calling in from other threads and loops

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the scheduler's loop from another thread and return its result.

        A KeyboardInterrupt (or a SystemExit from SIGTERM) while waiting cancels it: its
        requests are aborted on both engines, and it is raised again once they are released.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except (KeyboardInterrupt, SystemExit):
            future.cancel()
            # Only the coroutine's own end is waited out: a second interrupt meanwhile propagates at once.
            with contextlib.suppress(Exception):
                future.result(self.sync_timeout)
            raise

    async def bridge(self, aiter: AsyncIterator[T]) -> AsyncIterator[T]:
        """Iterate ``aiter`` (which runs on the scheduler's loop) from the caller's own loop; cancelling ends it."""
        caller = asyncio.get_running_loop()
        if caller is self.loop:
            async for item in aiter:
                yield item
            return
        inbox: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in aiter:
                    caller.call_soon_threadsafe(inbox.put_nowait, (item, None))
                caller.call_soon_threadsafe(inbox.put_nowait, (done, None))
            except BaseException as exc:  # delivered to the caller, which re-raises it
                caller.call_soon_threadsafe(inbox.put_nowait, (done, exc))

        task = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item, exc = await inbox.get()
                if item is done:
                    if exc is not None and not isinstance(exc, asyncio.CancelledError):
                        raise exc
                    return
                yield item
        finally:
            task.cancel()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the scheduler's loop from any asyncio loop; cancelling the caller cancels it."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    # ------------------------------------------------------------------ requests

    async def stream(self, request: DualRequest) -> AsyncIterator[SampleDelta]:
        """Draw one sample, yielding its tokens as the engines produce them (on the scheduler's loop).

        A caller that stops iterating aborts the request; the scheduler still drains both
        engines' outputs for it, so its slot is released only once both engines let it go.
        """
        self._check_alive()
        self._check_request(request)
        request_id = request.request_id or f"ds-{next(self._ids)}"
        if request_id in self._queued or request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already in flight")
        waiter = self.loop.create_future()
        self._queued[request_id] = waiter
        try:
            slot = await self._acquire_slot(waiter)
        finally:
            self._queued.pop(request_id, None)
            aborted = request_id in self._aborted_before_launch
            self._aborted_before_launch.discard(request_id)
        if aborted and slot is not None:  # aborted once its slot was handed over, before this resumed
            self._held.discard(slot)
            slot = None
        if slot is None:  # aborted while it waited for a slot: it never reached an engine
            sample = SampleRecord(text="", token_ids=[], finish_reason="abort", seed=request.sampling.seed)
            self.counters["requests"] += 1
            self.counters["finished_abort"] += 1
            yield SampleDelta([], np.zeros((0, len(RECORD_FIELDS)), np.float32), sample)
            return
        if self.failure is not None:  # the engines failed after this request got its slot
            self._held.discard(slot)
            raise self.failure
        flight = self._launch(request, slot, request_id)
        try:
            while True:
                delta = await flight.outbox.get()
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
                if delta.sample is not None:
                    return
        finally:
            if not flight.task.done():
                self.abort(flight.request_id)

    def _launch(self, request: DualRequest, slot: int, request_id: str) -> _Flight:
        """Open ``slot`` for ``request`` and start the task that talks to both engines (no await: atomic)."""
        key = next(self._keys)
        flight = _Flight(request_id, slot, key, request, versions=dict(self.versions))
        self._flights[flight.request_id] = flight
        self.counters["requests"] += 1
        self.session.open_slot(slot, key, len(request.teacher_prompt_ids), len(request.theta_prompt_ids))
        flight.task = asyncio.create_task(self._fly(flight))
        return flight

    async def _fly(self, flight: _Flight) -> None:
        """Submit one request to both engines, relay the teacher's tokens, and verify the end."""
        s, slot, request = self.session, flight.slot, flight.request
        try:
            teacher_params, theta_params = self._sampling_params(flight)
            theta_task = asyncio.create_task(
                _last(
                    self.engines.theta.generate(
                        {"prompt_token_ids": request.theta_prompt_ids}, theta_params, flight.request_id
                    )
                )
            )
            try:
                async for out in self.engines.teacher.generate(
                    {"prompt_token_ids": request.teacher_prompt_ids}, teacher_params, flight.request_id
                ):
                    completion = out.outputs[0]
                    new = list(completion.token_ids)
                    start = len(flight.tokens)
                    flight.tokens += new
                    # Records stop where the teacher's processor stopped writing them: a failed row's forced token
                    # has none, and the slot's rows past it still hold an earlier request's values.
                    end = min(len(flight.tokens), max(start, int(s.control[slot, Slot.NUM_RECORDS])))
                    k = request.sampling.top_logprobs
                    records = s.records[slot, start:end].copy()
                    top = (s.top_ids[slot, start:end, :k].copy(), s.top_logq[slot, start:end, :k].copy()) if k else None
                    dense = self._dense(slot, start, end, request.sampling.dense_logprobs)
                    if out.finished:
                        theta_out = await theta_task
                        sample = self._collect(flight, list(theta_out.outputs[0].token_ids), completion.finish_reason)
                        flight.outbox.put_nowait(SampleDelta(new, records, sample, top, dense))
                        return
                    if new:
                        flight.outbox.put_nowait(SampleDelta(new, records, top=top, dense=dense))
                raise SyncError("the teacher engine ended a request without a final output")
            finally:
                if not theta_task.done():
                    theta_task.cancel()
                await _settle(theta_task)
        except asyncio.CancelledError:
            flight.outbox.put_nowait(self.failure or SyncError("the dual engine was closed"))
            raise
        except Exception as exc:
            flight.outbox.put_nowait(self._engine_error(exc))
        finally:
            s.close_slot(slot)
            self._held.discard(slot)
            self._flights.pop(flight.request_id, None)

    async def sample(self, request: DualRequest) -> SampleRecord:
        """Draw one sample and return it whole."""
        async for delta in self.stream(request):
            if delta.sample is not None:
                return delta.sample
        raise SyncError("a sample's stream ended without its final record")

    def abort(self, request_id: str) -> bool:
        """End one request on both engines at the next step boundary; False if it is unknown or done.

        A request still waiting for a slot ends at once, without reaching an engine. Thread-safe:
        from another thread it runs on the scheduler's loop, where a request moves from queued to
        launched (slot opened) in one step, so an abort can never fall between the two.
        """
        if threading.get_ident() == self._thread.ident:
            return self._abort(request_id)
        if not self.loop.is_running():
            return False
        future = asyncio.run_coroutine_threadsafe(as_coroutine(self._abort, request_id), self.loop)
        while True:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                return future.result(_ABORT_POLL_S)
            if not self.loop.is_running() and not future.done():
                return False  # the loop stopped first: close() ended every request

    def _abort(self, request_id: str) -> bool:
        flight = self._flights.get(request_id)
        if flight is not None:
            self.session.request_abort(flight.slot, flight.key, Writer.DRIVER)
            return True
        waiter = self._queued.get(request_id)
        if waiter is None:
            return False
        if waiter.done():  # a slot was handed to it: stream() sees this before launching
            self._aborted_before_launch.add(request_id)
        else:
            waiter.set_result(None)
        return True

    @property
    def alive(self) -> bool:
        """Whether requests can be served: False for good once :attr:`failure` is set (health checks read this)."""
        return self.failure is None

    def in_flight(self) -> list[str]:
        """Request ids submitted to the engines (holding a slot) now."""
        return list(self._flights)

    # ------------------------------------------------------------------ weights

    async def update_weights(
        self,
        role: str,
        load: Callable[[Any], Coroutine[Any, Any, None]],
        *,
        mode: str = "wait",
        version: str | None = None,
    ) -> str:
        """Give the ``role`` engine new weights; returns its new version (on the scheduler's loop).

        ``load(engine)`` loads them (the caller checked them first). Until it returns no slot is
        handed out; the requests in flight finish first (``mode="wait"``) or are aborted
        (``mode="abort"``), so the engine loads with no request on either engine, between
        vLLM's pause and resume, and its prefix cache is reset after. Requests that wait for a
        slot meanwhile are drawn from the new weights. ``version`` labels the new weights (the
        default counts updates, "1", "2", ..., skipping labels earlier weights carried; a label given is the caller's
        to keep unique: ``best_of`` trusts labels to tell weights apart). A ``load`` that raises leaves the engine's
        weights unknown: the scheduler fails for good rather than sample from them.
        """
        check_update(role, mode, version)
        self._check_alive()
        async with self._update_lock:
            self._updating = True
            try:
                await self._quiesce(mode)
                engine = getattr(self.engines, role)
                try:
                    await engine.pause_generation(mode="keep", clear_cache=False)  # nothing runs: nothing to keep
                    await load(engine)
                    await engine.reset_prefix_cache()  # no KV of the old weights is reused
                    await engine.resume_generation()
                except Exception as exc:
                    raise self._fail(f"loading new {role} weights failed, so its weights are unknown: {exc!r}") from exc
                self.counters[f"{role}_updates"] += 1
                if version is None:  # the count of updates, or the next count no weights carried yet
                    count = self.counters[f"{role}_updates"]
                    while str(count) in self.labels_used[role]:
                        count += 1
                    version = str(count)
                self.versions[role] = version
                self.labels_used[role].add(self.versions[role])
                return self.versions[role]
            finally:
                self._updating = False

    async def pause(self, mode: str = "wait") -> None:
        """Hand out no slot until :meth:`resume`; returns once no request runs on either engine.

        The requests in flight finish (``mode="wait"``) or are aborted (``mode="abort"``, their
        samples say ``stop_reason="weight_update"``); those that wait for a slot keep waiting.
        Updates while paused load at once, and the pause outlasts them.
        """
        check_update(mode=mode)
        self._check_alive()
        self.paused = True
        await self._quiesce(mode)

    def resume(self) -> None:
        """Hand out slots again after :meth:`pause` (requests that waited start now)."""
        self.paused = False

    def set_version(self, role: str, version: str) -> None:
        """Label ``role``'s current weights ``version`` without changing them (samples launched from now carry it).

        A label the role's weights have carried before is refused: records of two different weights would name one.
        """
        if version is None:
            raise ValueError("version must be a non-empty string of at most 256 characters, got None")
        check_update(role=role, version=version)
        if version in self.labels_used[role] and version != self.versions[role]:
            raise ValueError(f"version {version!r} already labelled earlier {role} weights; choose a new label")
        self.versions[role] = version
        self.labels_used[role].add(version)

    @property
    def _gate_closed(self) -> bool:
        return self._updating or self.paused

    async def _quiesce(self, mode: str) -> None:
        """Wait until no slot is held (no request on either engine), aborting those in flight in ``mode="abort"``."""
        while self._held:
            self._check_alive()
            if mode == "abort":
                for request_id in list(self._flights):
                    if request_id not in self._update_aborts:
                        self._update_aborts.add(request_id)
                        self._abort(request_id)
            await asyncio.sleep(_SLOT_POLL_S)

    # ------------------------------------------------------------------ internals

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closing:
            raise SyncError("this dual engine is closed")

    def _check_request(self, request: DualRequest) -> None:
        longest = max(len(request.teacher_prompt_ids), len(request.theta_prompt_ids))
        if not request.teacher_prompt_ids or not request.theta_prompt_ids:
            raise ValueError("both prompts must hold at least one token")
        dense_max = self.session.layout.dense_k
        if request.sampling.dense_logprobs > dense_max:
            raise ValueError(
                f"dense_logprobs={request.sampling.dense_logprobs} exceeds this engine's max_dense_logprobs={dense_max}"
            )
        if request.max_tokens < 1 or longest + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens and max_tokens={request.max_tokens} exceed "
                f"max_model_len={self.max_model_len}"
            )

    def _sampling_params(self, flight: _Flight) -> tuple[Any, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        r = flight.request
        pairing = {"slot": flight.slot, "key": flight.key, "sampling": r.sampling.to_dict(), "stop": list(r.stop)}
        # Both engines run greedy on logits that allow one token; stop strings are the teacher scheduler's.
        teacher = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=r.max_tokens,
            min_tokens=0,
            stop_token_ids=list(r.sampling.stop_token_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"dual_sampling": pairing},
        )
        theta = teacher.clone()
        theta.output_kind = RequestOutputKind.FINAL_ONLY
        return teacher, theta

    async def _acquire_slot(self, waiter: asyncio.Future) -> int | None:
        """A free slot, first come first served; None if the request was aborted meanwhile (``waiter`` set to None)."""
        slot = None if self._slot_waiters or self._gate_closed else self._free_slot()
        if slot is not None:
            self._held.add(slot)
            return slot
        self._slot_waiters.append(waiter)
        if self._slot_feeder is None or self._slot_feeder.done():
            self._slot_feeder = asyncio.create_task(self._feed_slots())
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._held.discard(waiter.result())
            raise

    def _free_slot(self) -> int | None:
        for slot in range(self.session.layout.slots):
            if slot not in self._held and self.session.slot_free(slot):
                return slot
        return None

    async def _feed_slots(self) -> None:
        while self._slot_waiters:
            while self._slot_waiters and self._slot_waiters[0].done():
                self._slot_waiters.popleft()  # cancelled while waiting
            slot = self._free_slot() if self._slot_waiters and not self._gate_closed else None
            if slot is None:
                await asyncio.sleep(_SLOT_POLL_S)
                continue
            self._held.add(slot)
            self._slot_waiters.popleft().set_result(slot)

    def _dense(self, slot: int, start: int, end: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of a slot's dense top-k records for tokens [start, end), or None when k is 0."""
        if not k:
            return None
        s = self.session
        return s.dense_ids[slot, start:end, :, :k].copy(), s.dense_logp[slot, start:end, :, :k].copy()

    def _collect(self, flight: _Flight, theta_tokens: list[int], teacher_finish: str | None) -> SampleRecord:
        """The verified sample of a request both engines have ended."""
        s, slot, tokens = self.session, flight.slot, flight.tokens
        control = s.control[slot]
        code, step = s.error(slot)
        finish = Finish(int(control[Slot.FINISH])) if int(control[Slot.PHASE]) == Phase.FINISHED else Finish.NONE
        stop_index = int(control[Slot.STOP_INDEX])
        recorded = s.tokens[slot, : len(tokens)].tolist()
        records = s.records[slot, : len(tokens)].copy()
        # Three independent streams: what the teacher processor decided, and what each engine emitted.
        sample = SampleRecord(
            text="",
            token_ids=recorded,
            finish_reason=finish.reason or teacher_finish,
            seed=flight.request.sampling.seed,
            teacher_token_ids=list(tokens),
            theta_token_ids=theta_tokens,
            teacher_version=flight.versions["teacher"],
            theta_version=flight.versions["theta"],
        )
        if code == ErrorCode.NONE and (
            theta_tokens != tokens or recorded != tokens or int(control[Slot.NUM_RECORDS]) < len(tokens)
        ):
            code, step = ErrorCode.DIVERGED, _first_difference(tokens, theta_tokens, recorded)
        non_finite = np.flatnonzero(~np.isfinite(records).all(axis=1))
        if code == ErrorCode.NONE and non_finite.size:  # the engine checks each row; this is the last line
            code, step = ErrorCode.NON_FINITE, int(non_finite[0])
        if code != ErrorCode.NONE:
            sample.finish_reason = "error"
            sample.error = f"{code.label} at step {step}"
            self.counters[f"failed_{code.label}"] += 1
        else:
            sample.alpha, sample.logp_teacher, sample.logp_theta, sample.logq = (
                records[:, k].tolist() for k in range(len(RECORD_FIELDS))
            )
            dense = self._dense(slot, 0, len(tokens), flight.request.sampling.dense_logprobs)
            if dense is not None:
                sample.dense_ids, sample.dense_logp = dense
            self.counters["tokens"] += len(tokens)
        stop = (
            flight.request.stop[stop_index]
            if finish == Finish.STOP_STRING and 0 <= stop_index < len(flight.request.stop)
            else None
        )
        sample.stop_reason = stop if stop is not None else (tokens[-1] if finish == Finish.STOP and tokens else None)
        if flight.request_id in self._update_aborts:
            self._update_aborts.discard(flight.request_id)
            if sample.finish_reason == "abort":
                sample.stop_reason = "weight_update"
        sample.text = sample_text(self.tokenizer, tokens, stop, stop_token=finish == Finish.STOP)
        self.counters[f"finished_{sample.finish_reason}"] += 1
        return sample

    def _engine_error(self, exc: Exception) -> Exception:
        """The error a request gets when its engine call raised."""
        if self.failure is not None:
            return self.failure
        from vllm.v1.engine.exceptions import EngineDeadError

        dead = self._dead_engine()
        if dead is None and isinstance(exc, EngineDeadError):
            dead = f"an engine failed: {exc}"
        if dead is not None:
            return self._fail(dead)
        if isinstance(exc, (SyncError, ValueError)):
            return exc
        return SyncError(f"an engine call failed: {type(exc).__name__}: {exc}")

    def _dead_engine(self) -> str | None:
        """Why an engine can serve nothing more (its process exited, or vLLM declared it dead), else None.

        After an exception inside a live EngineCore, vLLM raises EngineDeadError to every later
        call while the engine's processes may still be there: its ``errored`` flag says so.
        """
        if self.engines is None:
            return None
        dead = self.engines.dead()
        if dead:
            return f"the {dead} engine failed: its engine process exited"
        for role in ("teacher", "theta"):
            if getattr(getattr(self.engines, role), "errored", False):
                return f"the {role} engine failed: vLLM declared it dead (EngineDeadError)"
        return None

    def _fail(self, message: str) -> SyncError:
        """Stop serving: record why, release the engines' waits, and stop the engines."""
        if self.failure is None:
            self.failure = SyncError(message)
            logger.error("%s; closing the dual engine", message)
            self.session.shutdown()
            # A closed engine's output streams never end: every request ends here, with the failure.
            for flight in list(self._flights.values()):
                if flight.task is not None and flight.task is not asyncio.current_task():
                    flight.task.cancel()
            for waiter in self._queued.values():
                if not waiter.done():
                    waiter.set_exception(self.failure)
            asyncio.get_running_loop().run_in_executor(None, self._close_engines)
        return self.failure

    async def _watch(self) -> None:
        """Fail fast when an engine process dies, or when nothing moves while requests wait on the engines.

        Moving is serving a row, or computing: a step that prefills many long prompts serves no
        row for minutes on a CPU while its models keep the cores busy.
        """
        last_rows, last_move, last_cpu = None, time.monotonic(), 0.0
        while self.failure is None and not self._closing:
            await asyncio.sleep(_WATCH_S)
            dead = self._dead_engine()
            if dead:
                self._fail(dead)
                return
            stats = self.session.statistics()
            rows = (stats["teacher_rows"], stats["theta_rows"], stats["leader_ended"])
            cpu = self.engines.worker_cpu_seconds() if self.engines is not None else 0.0
            computing = cpu - last_cpu >= _COMPUTING_CPU_SHARE * _WATCH_S
            last_cpu = cpu
            if rows != last_rows or computing or not self._flights:
                last_rows, last_move = rows, time.monotonic()
            elif time.monotonic() - last_move > self.sync_timeout + _STALL_GRACE_S:
                self._fail(
                    f"neither engine served a row or computed for {self.sync_timeout + _STALL_GRACE_S:.0f} s "
                    f"({len(self._flights)} requests in flight); an engine stopped responding"
                )
                return

    def statistics(self) -> dict[str, float]:
        """The engines' counters (rows, waits, timeouts, plans) and the driver's (requests, tokens, failures)."""
        stats: dict[str, float] = {}
        if not self.session.closed:
            stats.update(self.session.statistics())
        for name in [k for k in stats if k.endswith("_ns")]:
            stats[name[:-3] + "_s"] = stats.pop(name) / 1e9
        stats.update(self.counters)
        stats["in_flight"] = len(self._flights)
        stats["queued"] = len(self._queued)
        return stats

    def _close_engines(self) -> None:
        """Stop the engines once; a second caller (close() while _fail's closing runs) waits for the first."""
        with self._engines_lock:
            if self.engines is not None and not self._engines_closed:
                self._engines_closed = True
                self.engines.close()

    def close(self) -> None:
        """Abort what is in flight, stop both engines, remove the shared memory. Safe to call twice."""
        if self._closing and self.session.closed:
            return
        self._closing = True
        atexit.unregister(self.close)
        if self.failure is None:
            self.failure = SyncError("this dual engine is closed")
        if not self.session.closed:
            self.session.shutdown()
        try:
            if self.loop.is_running():
                with contextlib.suppress(Exception):  # tasks still running after 10 s end with the engines
                    asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(10)
        finally:  # an interrupt while the tasks end still stops the engines, then propagates
            self._close_engines()
            self.engines = None
            if self.loop.is_running():
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
            self.session.close()

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=5) if tasks else None


def check_update(role: str | None = None, mode: str | None = None, version: str | None = None) -> None:
    """Refuse, naming the argument, a role, update mode or version label the weight operations cannot take.

    Each argument left None is not checked (a version of None asks for the default label).
    """
    if role is not None and role not in ("teacher", "theta"):
        raise ValueError(f"role must be 'teacher' or 'theta', got {role!r}")
    if mode is not None and mode not in UPDATE_MODES:
        raise ValueError(f"mode must be one of {UPDATE_MODES}, got {mode!r}")
    if version is not None and (not isinstance(version, str) or not version or len(version) > 256):
        raise ValueError(f"version must be a non-empty string of at most 256 characters, got {version!r}")


async def as_coroutine(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` as a coroutine, to run it on the scheduler's loop from another thread."""
    return function(*args)


async def _settle(task: asyncio.Task) -> None:
    """Wait for ``task`` to end, whatever it ended with; a cancellation of the awaiting task itself propagates."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # the partner's own error: the teacher's outcome (or its error) decides the request
        pass


async def _last(aiter: AsyncIterator[T]) -> T:
    last = None
    async for item in aiter:
        last = item
    if last is None:
        raise SyncError("an engine ended a request without any output")
    return last


def _first_difference(*streams: list[int]) -> int:
    """The first position where the token streams disagree (or where the shorter one ends)."""
    for i, values in enumerate(itertools.zip_longest(*streams)):
        if len(set(values)) > 1:
            return i
    return 0
