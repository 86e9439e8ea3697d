"""The long-lived driver of engines in lockstep, one per model of the roster (a pair: two), requests accepted at any
time.

:class:`LockstepDriver` owns one shared-memory session and the engines, on an asyncio
loop of its own (:mod:`~dual_sampling.driver.loop_thread`). Per sample it:

1. waits for a free slot, first come first served (:mod:`~dual_sampling.driver.slots`; the
   slot count bounds what is submitted to the engines, whose schedulers decide what runs);
2. opens the slot and submits each model's prompt to its engine;
3. streams the leading engine's tokens with their records (:class:`SampleDelta`);
4. when every engine has ended the request, checks that each produced the same tokens that
   were decided, reads why it ended, and returns the verified :class:`SampleRecord`
   (:mod:`~dual_sampling.driver.collect`).

:meth:`LockstepDriver.abort` ends one request on both engines at the next step boundary (the
teacher engine's scheduler decides it; see ``processors.scheduler``). A request that fails (a
timeout, bad logits, a divergence) fails alone: its sample carries ``finish_reason="error"``
and a named ``error``; an engine call that raises for one request raises
:class:`RequestFailed` to that request alone. An engine that dies, or a pair in which nothing
moves (:mod:`~dual_sampling.driver.health`), fails every request in flight or queued with
:class:`EnginePairDead` and closes the driver for good (:attr:`LockstepDriver.failure`).

:meth:`LockstepDriver.update_weights` gives one engine new weights while both stay in
lockstep: no slot is handed out meanwhile, the requests in flight finish on the old weights
(``mode="wait"``) or end with ``finish_reason="abort"`` and ``stop_reason="weight_update"``
(``mode="abort"``), and only with no request on either engine does the engine load the
weights (vLLM's pause, ``reload_weights`` and ``reset_prefix_cache``, then resume). So every
sample is drawn from one version of each model, and it records which
(:mod:`~dual_sampling.driver.versions`). :meth:`LockstepDriver.pause` with ``mode="keep"`` instead holds the
requests in flight where they are (:meth:`~LockstepDriver.hold`): θ updates taken meanwhile load at once, and the
held requests go on after :meth:`~LockstepDriver.resume` under the new θ, their KV caches recomputed; each such
sample names the θ version of every token (``theta_versions``).

Another mode's driver (``dual_sampling.modes``) is this class with its public *mode hooks* replaced:
:meth:`~LockstepDriver.start_engines`, :meth:`~LockstepDriver.relay`, :meth:`~LockstepDriver.abort_launched`,
:meth:`~LockstepDriver.check`, :meth:`~LockstepDriver.update_weights` and :meth:`~LockstepDriver.statistics`; slots,
queueing, failure handling and records stay here. No mode overrides a private method (``tests/test_modes.py``).

The module is over 500 lines because a request's life (queued, launched, relayed, aborted, paused for an update,
closed) is one state machine on one loop, whose invariants are easier to hold in one place.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, NoReturn

import numpy as np

from dual_sampling.driver import statistics
from dual_sampling.driver.collect import collect_sample, delta_of
from dual_sampling.driver.health import HealthWatch, dead_engine
from dual_sampling.driver.loop_thread import LoopThread
from dual_sampling.driver.requests import DualRequest, Flight, check_request, engine_sampling_params, model_prompts
from dual_sampling.driver.slots import SlotPool
from dual_sampling.driver.versions import PAUSE_MODES, WeightVersions, check_update
from dual_sampling.lockstep import (
    EnginePairDead,
    ErrorCode,
    RequestFailed,
    SessionLayout,
    Slot,
    SyncError,
    SyncSession,
    Writer,
)
from dual_sampling.records import SampleDelta, SampleRecord
from dual_sampling.roster import PAIR, Role, Roster

__all__ = ["LockstepDriver"]

logger = logging.getLogger(__name__)


class LockstepDriver:
    """Engines in lockstep behind one asyncio API, one per model of ``roster``; see the module docstring.

    ``engine_factory(session_name)`` builds the engines on the driver's loop, with their ``engines`` by model name
    in roster order (the real ones: :class:`dual_sampling.driver.pair.EnginePair`; tests pass simulated engines).
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
        roster: Roster = PAIR,
    ) -> None:
        self.tokenizer = tokenizer
        self.roster = roster
        self.max_model_len = max_model_len
        self.sync_timeout = sync_timeout
        layout = SessionLayout(
            vocab=vocab,
            slots=slots or 2 * max_num_seqs + 2,
            max_steps=max_model_len,
            plan_width=max_num_seqs,
            dense_k=max_dense_logprobs,
            models=len(roster.names),
        )
        self.session = SyncSession.create(layout)
        self.session.names = roster.names
        self.slots = SlotPool(self.session)
        self.engines: Any = None
        self.failure: SyncError | None = None
        """Set once, for good, when the driver can serve nothing more (an engine died, or it was closed)."""
        self.counters = statistics.new_counters()
        self.versions = WeightVersions(roster)
        self.alpha: tuple[str, dict[str, Any]] | None = None
        """The alpha method and configuration the leader's processor decides with, once changed by
        :meth:`update_alpha`; None: the one it started with."""
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)
        self._flights: dict[str, Flight] = {}
        self._queued: dict[str, asyncio.Future] = {}
        """Requests waiting for a slot, by id; an abort resolves the future with None."""
        self._aborted_before_launch: set[str] = set()
        """Requests aborted after a slot was handed to them but before they reached the engines."""
        self._update_aborts: set[str] = set()
        """Requests aborted by an update, so their samples say why."""
        self._holding = False
        """``pause(mode="keep")`` holds the requests in flight: every engine is paused with vLLM's ``keep``."""
        self._closing = False
        self._engines_lock = threading.Lock()
        self._engines_closed = False
        self.thread = LoopThread("dual-sampling-loop", interrupt_wait=sync_timeout)
        atexit.register(self.close)  # an exception or a signal that ends the program still stops the engines
        try:
            self.engines = self.thread.call(self.start_engines(engine_factory))
        except BaseException:
            self.close()
            raise

    async def start_engines(self, engine_factory: Callable[[str], Any]) -> Any:
        """Mode hook: build the engines on the driver's loop and start watching their health; returns them."""
        self._update_lock = asyncio.Lock()
        engines = engine_factory(self.session.name)
        watch = HealthWatch(
            self.session,
            self.sync_timeout,
            engines=lambda: self.engines,
            in_flight=lambda: 0 if self._holding else len(self._flights),  # held requests are not stalled
            stopped=lambda: self.failure is not None or self._closing,
            fail=self._fail,
        )
        self._watch_task = asyncio.create_task(watch.run())
        return engines

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.thread.loop

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the driver's loop from another thread and return its result (see :meth:`LoopThread.call`)."""
        return self.thread.call(coro, timeout)

    # ------------------------------------------------------------------ requests

    async def stream(self, request: DualRequest) -> AsyncIterator[SampleDelta]:
        """Draw one sample, yielding its tokens as the engines produce them (on the driver's loop).

        A caller that stops iterating (or is cancelled) aborts the request, and the stream ends only once both
        engines have let it go and its slot is released.
        """
        self._check_alive()
        self.check(request)
        request_id = request.request_id or f"ds-{next(self._ids)}"
        if request_id in self._queued or request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already in flight")
        waiter = self.loop.create_future()
        self._queued[request_id] = waiter
        try:
            slot = await self.slots.acquire(waiter)
        finally:
            self._queued.pop(request_id, None)
            aborted = request_id in self._aborted_before_launch
            self._aborted_before_launch.discard(request_id)
        if aborted and slot is not None:  # aborted once its slot was handed over, before this resumed
            self.slots.release(slot)
            slot = None
        if slot is None:  # aborted while it waited for a slot: it never reached an engine
            sample = SampleRecord(text="", token_ids=[], finish_reason="abort", seed=request.sampling.seed)
            self.counters["requests"] += 1
            self.counters["finished_abort"] += 1
            yield SampleDelta([], np.zeros((0, len(self.roster.token_columns)), np.float32), sample)
            return
        if self.failure is not None:  # the engines failed after this request got its slot
            self.slots.release(slot)
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
                # Back to the caller only once both engines let the request go: a consumer that stops early, or a
                # Ctrl-C in generate(), leaves nothing in flight. (asyncio.wait neither raises the flight's own error
                # nor cancels it; a second cancellation of this caller still ends the wait at once.)
                await asyncio.wait([flight.task])

    def check(self, request: DualRequest) -> None:
        """Refuse, naming the field, a request this driver cannot serve (:meth:`stream` runs it first)."""
        check_request(request, self.max_model_len, self.session.layout.dense_k, self.roster)

    async def sample(self, request: DualRequest) -> SampleRecord:
        """Draw one sample and return it whole."""
        async for delta in self.stream(request):
            if delta.sample is not None:
                return delta.sample
        raise RequestFailed("a sample's stream ended without its final record")

    def _launch(self, request: DualRequest, slot: int, request_id: str) -> Flight:
        """Open ``slot`` for ``request`` and start the task that talks to the engines (no await: atomic)."""
        prompts = model_prompts(self.roster, request.teacher_prompt_ids, request.theta_prompt_ids)  # checked by check()
        flight = Flight(request_id, slot, next(self._keys), request, versions=dict(self.versions.current))
        self._flights[flight.request_id] = flight
        self.counters["requests"] += 1
        running = request.models(self.roster)
        self.session.open_slot(
            slot, flight.key, [len(ids) for ids in prompts], [self.roster.position(name) for name in running]
        )
        flight.task = asyncio.create_task(self._fly(flight))
        return flight

    async def _fly(self, flight: Flight) -> None:
        """Run one request (:meth:`relay`); its end, however it comes, reaches the caller's stream."""
        try:
            await self.relay(flight)
        except asyncio.CancelledError:
            flight.outbox.put_nowait(self.failure or EnginePairDead("the dual engine was closed"))
            raise
        except Exception as exc:
            flight.outbox.put_nowait(self._engine_error(exc))
        finally:
            self.session.close_slot(flight.slot)
            self.slots.release(flight.slot)
            self._flights.pop(flight.request_id, None)

    async def relay(self, flight: Flight) -> None:
        """Mode hook: submit one request to the engines, put its deltas and its final sample in ``flight.outbox``.

        Here: to every engine; the leader's tokens are relayed and the end verified against each follower's."""
        request, engines = flight.request, self.engines.engines
        leader, *followers = request.models(self.roster)  # the models a request leaves out never see it
        ids = model_prompts(self.roster, request.teacher_prompt_ids, request.theta_prompt_ids)
        prompts = dict(zip(self.roster.names, ids))
        leader_params, follower_params = engine_sampling_params(flight)
        tasks = {
            name: asyncio.create_task(
                _last(engines[name].generate({"prompt_token_ids": prompts[name]}, follower_params, flight.request_id))
            )
            for name in followers
        }
        try:
            async for out in engines[leader].generate(
                {"prompt_token_ids": prompts[leader]}, leader_params, flight.request_id
            ):
                completion = out.outputs[0]
                start = len(flight.tokens)
                flight.tokens += completion.token_ids
                if out.finished:
                    ended = {name: list((await task).outputs[0].token_ids) for name, task in tasks.items()}
                    sample = self.finish(flight, ended, completion.finish_reason)
                    flight.outbox.put_nowait(delta_of(self.session, flight, start, sample))
                    return
                if len(flight.tokens) > start:
                    flight.outbox.put_nowait(delta_of(self.session, flight, start))
            raise RequestFailed("the leading engine ended a request without a final output")
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()
            for task in tasks.values():
                await _settle(task)

    def finish(self, flight: Flight, follower_tokens: dict[str, list[int]], leader_finish: str | None) -> SampleRecord:
        """The verified sample of a request the engines have ended, counted (for :meth:`relay`); ``follower_tokens``:
        what each following engine emitted, by model name."""
        sample, code = collect_sample(self.session, flight, self.roster, follower_tokens, leader_finish, self.tokenizer)
        if code != ErrorCode.NONE:
            self.counters[f"failed_{code.label}"] += 1
        else:
            self.counters["tokens"] += len(flight.tokens)
        if flight.request_id in self._update_aborts:
            self._update_aborts.discard(flight.request_id)
            if sample.finish_reason == "abort":
                sample.stop_reason = "weight_update"
        self.counters[f"finished_{sample.finish_reason}"] += 1
        return sample

    def abort(self, request_id: str) -> bool:
        """End one request on both engines at the next step boundary; False if it is unknown or done.

        A request still waiting for a slot ends at once, without reaching an engine. Thread-safe:
        from another thread it runs on the driver's loop, where a request moves from queued to
        launched (slot opened) in one step, so an abort can never fall between the two.
        """
        if self.thread.on_loop:
            return self._abort(request_id)
        return self.thread.submit(self._abort, request_id, default=False)  # a stopped loop: close() ended them all

    def _abort(self, request_id: str) -> bool:
        flight = self._flights.get(request_id)
        if flight is not None:
            self.abort_launched(flight)
            return True
        waiter = self._queued.get(request_id)
        if waiter is None:
            return False
        if waiter.done():  # a slot was handed to it: stream() sees this before launching
            self._aborted_before_launch.add(request_id)
        else:
            waiter.set_result(None)
        return True

    def abort_launched(self, flight: Flight) -> None:
        """Mode hook: end a request that reached the engines (on the loop; no await). Here: the session's abort
        word, which both engines' schedulers read at the next step boundary."""
        self.session.request_abort(flight.slot, flight.key, Writer.DRIVER)

    @property
    def alive(self) -> bool:
        """Whether requests can be served: False for good once :attr:`failure` is set (health checks read this)."""
        return self.failure is None

    def in_flight(self) -> list[str]:
        """Request ids submitted to the engines (holding a slot) now."""
        return list(self._flights)

    def statistics(self) -> dict[str, float | str]:
        """The engines' counters (rows, waits, timeouts, plans) and the driver's (requests, tokens, failures), and the
        row channel's transport (``row_transport``)."""
        stats: dict[str, float | str] = statistics.statistics(
            self.session, self.counters, self.versions, len(self._flights), len(self._queued)
        )
        stats["row_transport"] = getattr(self.engines, "row_transport", "host")
        return stats

    # ------------------------------------------------------------------ weights

    async def update_weights(
        self,
        role: Role | str,
        load: Callable[[Any], Coroutine[Any, Any, None]],
        *,
        mode: str = "wait",
        version: str | None = None,
    ) -> str:
        """Give the ``role`` engine new weights; returns its new version (on the driver's loop).

        ``load(engine)`` loads them (the caller checked them first). Until it returns no slot is
        handed out; the requests in flight finish first (``mode="wait"``) or are aborted
        (``mode="abort"``), so the engine loads with no request on either engine, between
        vLLM's pause and resume, and its prefix cache is reset after. Requests that wait for a
        slot meanwhile are drawn from the new weights. ``version`` labels the new weights (the
        default counts updates, "1", "2", ..., skipping labels earlier weights carried; a label given is the caller's
        to keep unique: ``best_of`` trusts labels to tell weights apart). A ``load`` that raises leaves the engine's
        weights unknown: the driver fails for good rather than sample from them (so does one cancelled half way).
        """
        check_update(role, mode, version)
        role = Role(role)
        self.versions.check_model(role)
        async with self._no_request_running(mode):
            if self._holding and role != Role.THETA:
                raise ValueError(
                    f"role={role.value!r}: requests held by pause(mode='keep') record θ's version per token only; "
                    "update the teacher outside such a pause"
                )
            if self._holding and mode == "abort":
                raise ValueError("mode='abort': the requests in flight are held by pause(mode='keep'); resume() first")
            engine = self.engine_holding(role)
            try:
                if not self._holding:  # held, it is paused already, and stays paused until resume()
                    await engine.pause_generation(mode="keep", clear_cache=False)  # nothing runs: nothing to keep
                await load(engine)
                await engine.reset_prefix_cache()  # no KV of the old weights is reused
                if not self._holding:
                    await engine.resume_generation()
            except BaseException as exc:
                # A load stopped half way (an error, or a Ctrl-C cancelling it) leaves the weights unknown, and the
                # worker possibly inside vLLM's layerwise reload: no request may run on them.
                self._fail_half_way(f"loading new {role} weights failed, so its weights are unknown", exc)
            version = self.versions.updated(role, version)
            if self._holding:  # the held requests' tokens drawn so far are final, the next are the new θ's
                for flight in self._flights.values():
                    flight.theta_changes.append((int(self.session.control[flight.slot, Slot.NUM_RECORDS]), version))
            return version

    def engine_holding(self, role: Role) -> Any:
        """The engine whose workers hold model ``role``'s weights (its own, in lockstep)."""
        return self.engines.engines[role]

    async def update_alpha(self, method: str, config: dict[str, Any]) -> None:
        """Give the leader's processor the alpha computer ``method`` with ``config`` (the caller checked both), once
        no request runs on either engine (those in flight finish first; those waiting for a slot start after it). A
        call that fails leaves the computer unknown: the driver fails for good."""
        async with self._no_request_running("wait"):
            if self._holding:  # its contract: the requests in flight finish on the computer they started with
                raise ValueError("the requests in flight are held by pause(mode='keep'): resume() before a new alpha")
            try:
                leader = self.engines.engines[self.roster.names[0]]
                taken = await leader.collective_rpc("dual_sampling_set_alpha", args=(method, config))
            except Exception as exc:
                raise self._fail(f"setting the alpha computer failed, so it is unknown: {exc!r}") from exc
            if sum(taken) != 1:
                raise self._fail(f"the leading engine's workers had {sum(taken)} leader processors, not 1")
            self.alpha = (method, dict(config))
            self.counters["alpha_updates"] += 1

    @contextlib.asynccontextmanager
    async def _no_request_running(self, mode: str) -> AsyncIterator[None]:
        """Hold the gate closed (no slot is handed out) while no request runs on either engine: the requests in flight
        finish first (``mode="wait"``) or are aborted (``mode="abort"``). One such change at a time."""
        self._check_alive()
        async with self._update_lock:
            self.slots.updating = True
            try:
                if not self._holding:  # held requests wait for resume(): nothing of theirs runs meanwhile
                    await self._quiesce(mode)
                yield
            finally:
                self.slots.updating = False

    async def pause(self, mode: str = "wait") -> None:
        """Hand out no slot until :meth:`resume`; returns once no request runs on either engine.

        The requests in flight finish (``mode="wait"``), are aborted (``mode="abort"``, their
        samples say ``stop_reason="weight_update"``) or are held where they are (``mode="keep"``,
        :meth:`hold`); those that wait for a slot keep waiting. Updates while paused load at once,
        and the pause outlasts them.
        """
        check_update(mode=mode, modes=PAUSE_MODES)
        self._check_alive()
        if self._holding and mode != "keep":
            raise ValueError(f"mode={mode!r}: the requests in flight are held by pause(mode='keep'); resume() first")
        self.slots.paused = True
        if mode == "keep":
            await self.hold()
        else:
            await self._quiesce(mode)

    async def hold(self) -> None:
        """Hold every request in flight where it is, on every engine, until :meth:`resume`.

        The leader's engine is paused first with vLLM's ``keep`` (so it publishes no more plans), then the session's
        hold lets each follower run the plans published before it, and the followers are paused likewise
        (``processors.scheduler``, "Holding"). vLLM's ``keep`` resets each engine's KV cache, preempting what runs:
        after the resume every held request recomputes its cache under the weights the engines hold then. A pause
        that fails half way leaves the engines' state unknown: the driver fails for good.
        """
        async with self._update_lock:
            if self._holding:
                return
            leader, *followers = (self.engines.engines[name] for name in self.roster.names)
            try:
                await leader.pause_generation(mode="keep", clear_cache=True)
                self.session.hold(True)
                await asyncio.gather(*(engine.pause_generation(mode="keep", clear_cache=True) for engine in followers))
            except BaseException as exc:
                self._fail_half_way("holding the requests in flight failed, the engines' state is unknown", exc)
            self._holding = True

    async def resume(self) -> None:
        """Hand out slots again after :meth:`pause` (requests that waited start now); requests held by
        ``pause(mode="keep")`` go on first, under the weights the engines hold now."""
        async with self._update_lock:  # not half way through a hold(): it would hold after this resume
            if self._holding:
                self.session.hold(False)
                try:
                    await asyncio.gather(*(engine.resume_generation() for engine in self.engines.engines.values()))
                except BaseException as exc:
                    # Engines resumed and engines paused would step out of phase: no request may run on them.
                    self._fail_half_way("resuming the held requests failed, the engines' state is unknown", exc)
                self._holding = False
            self.slots.paused = False

    @property
    def paused(self) -> bool:
        return self.slots.paused

    async def _quiesce(self, mode: str) -> None:
        """Wait until no slot is held (no request on either engine), aborting those in flight in ``mode="abort"``."""

        def each_poll() -> None:
            self._check_alive()
            if mode == "abort":
                for request_id in list(self._flights):
                    if request_id not in self._update_aborts:
                        self._update_aborts.add(request_id)
                        self._abort(request_id)

        await self.slots.drain(each_poll)

    # ------------------------------------------------------------------ failures and closing

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closing:
            raise EnginePairDead("this dual engine is closed")

    def _engine_error(self, exc: Exception) -> Exception:
        """The error a request gets when its engine call raised."""
        if self.failure is not None:
            return self.failure
        from vllm.v1.engine.exceptions import EngineDeadError

        dead = dead_engine(self.engines)
        if dead is None and isinstance(exc, EngineDeadError):
            dead = f"an engine failed: {exc}"
        if dead is not None:
            return self._fail(dead)
        if isinstance(exc, (SyncError, ValueError)):
            return exc
        return RequestFailed(f"an engine call failed: {type(exc).__name__}: {exc}")

    def _fail_half_way(self, what: str, exc: BaseException) -> NoReturn:
        """Inside an ``except`` block: a change of the engines stopped half way (an error, or a Ctrl-C cancelling it),
        so no request may run on them: fail for good, and raise the failure (or the interruption itself)."""
        failure = self._fail(f"{what}: {exc!r}")
        if isinstance(exc, Exception):
            raise failure from exc
        raise exc

    def _fail(self, message: str) -> EnginePairDead:
        """Stop serving: record why, release the engines' waits, and stop the engines."""
        if self.failure is None:
            self.failure = EnginePairDead(message)
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
            self.failure = EnginePairDead("this dual engine is closed")
        if not self.session.closed:
            self.session.shutdown()
        try:
            if self.loop.is_running():
                with contextlib.suppress(Exception):  # tasks still running after 10 s end with the engines
                    asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(10)
        finally:  # an interrupt while the tasks end still stops the engines, then propagates
            self._close_engines()
            self.engines = None
            self.thread.stop()
            self.session.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5) if tasks else None


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


async def _last(aiter: AsyncIterator[Any]) -> Any:
    last = None
    async for item in aiter:
        last = item
    if last is None:
        raise RequestFailed("an engine ended a request without any output")
    return last
