"""vLLM scheduler plugins that make every engine of a roster run the same requests at every step, by construction.

Each engine runs one subclass of vLLM's ``Scheduler`` inside its EngineCore process
(``LLM(scheduler_cls=...)``): the leader's engine (roster position 0; the teacher's in a pair)
:class:`LeaderScheduler`, each follower's (θ's in a pair)
:class:`FollowerScheduler`. They agree through the session's shared memory
(``dual_sampling.lockstep``):

- **Arrival.** Each scheduler marks a request arrived (its key in its model's slot word) once
  it sits in its queue. The leader admits only requests that have arrived on every engine, so
  each follower always holds what a plan names. Nothing is timed but the wait for a diverse group (below).
- **Admission.** Before each step the leader picks the requests to admit, first come first
  served, within the seats left and the token budget of *every* engine (each prompt counted
  in full, as if nothing were cached). It shows vLLM's scheduler only those, then publishes
  the step's *plan*: the keys of every request in the batch.
- **Groups.** The members of a diverse group (``RowSampling.diverse``: n samples of one prompt with a
  diversity penalty, decided in order at each step) are admitted in one step when all of them have arrived and fit;
  the leader holds a group's first member for that at most :data:`GROUP_WAIT_S` after it arrived, then admits the
  members as they come (a member aborted before admission never arrives). The only timed rule: it changes which
  members share a step, never a record (each member's log q is the law it drew from).
- **Following.** Each follower waits for each plan (it never runs a step without one), ends
  what the leader ended, admits exactly the plan's new requests, and checks that its batch
  equals the plan. A plan entry it cannot run fails that request alone (``diverged``).
- **Ending.** EOS, stop token ids and max_tokens end a request on every engine at the same
  step, because every engine sees the same tokens and the same stop criteria. Everything
  else is decided by the leader alone and reaches the followers as an ending before the
  next plan: aborts (from the driver, or vLLM's own aborts, which are turned into lockstep
  ones instead of ending one engine early), stop strings, and failed requests. Stop strings
  are watched per request (``dual_sampling.text.StopStringWatch``, dropped with the request);
  a check that raises fails its request alone (``decision_error``). Each role ends a
  request in one method, ``_end``, given a :class:`Finish` (vLLM's status follows from its
  reason): the leader's records the end in the slot, then ends the request in its engine;
  the follower's ends what the leader recorded, or fails a request it cannot run, whose
  error in the slot the leader then ends on its side.
- **Preemption** cannot happen with the KV cache the driver verifies; if vLLM preempts
  anyway, the request fails (``preempted``) instead of silently diverging. The one preemption taken is the driver's
  own, on every engine at once: ``pause(mode="keep")``.
- **Holding** (``pause(mode="keep")``). The driver pauses the leader's engine with vLLM's ``keep`` first, so no
  plan follows, then raises the session's hold (:meth:`SyncSession.hold`): each follower runs the plans published
  before it, then steps nothing (:meth:`LockstepScheduler.held_output`) until vLLM pauses it too, so no engine waits
  inside a step for another. vLLM's ``keep`` resets each engine's KV cache and so preempts its running requests on
  all engines alike (:meth:`LockstepScheduler.reset_prefix_cache` notes them). After the resume they are admitted
  again like new ones (the leader counting prompt and generated tokens) and recompute their KV cache with whatever
  weights the engines hold then: no token is drawn over a cache that other weights computed.

Waits block on futex doorbells. With requests running, the follower waits for the next
plan until ``sync_timeout`` (then fails them); otherwise every scheduler waits at most
:data:`IDLE_WAIT_S` so that the EngineCore keeps reading its input.

One module over 500 lines: the leader and the follower share their ending of a request and
their waits, and each is the other's contract.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from dual_sampling.lockstep import (
    PLAN_RING,
    Bell,
    ErrorCode,
    Finish,
    Header,
    LockstepConfig,
    ModelSlot,
    ModelWord,
    Phase,
    Slot,
    Stat,
    SyncSession,
    Writer,
    slot_word,
    watch_driver,
)
from dual_sampling.text import StopStringWatch, engine_tokenizer
from processors.base import WAIT_CAP_S, check_roster, request_pairing

__all__ = [
    "IDLE_WAIT_S",
    "FollowerScheduler",
    "LeaderScheduler",
    "LockstepScheduler",
    "plan_entry",
    "split_plan_entry",
]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02
"""Longest wait inside ``schedule()`` when no request runs: the EngineCore reads new requests between calls."""
GROUP_WAIT_S = 0.25
"""Longest hold of a diverse group's first member for the rest of its group (seconds after it arrived)."""
MAX_TRACKED_GROUPS = 4096
"""Diverse groups whose admitted members the leader counts at once (the oldest go first: a group whose members were
aborted never completes)."""

_STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}
"""vLLM's request status for each finish reason of :class:`Finish` (vLLM maps a status back to its reason)."""


def _status_of(finish: Finish) -> RequestStatus:
    """vLLM's request status for ``finish``; aborted for an ending without a reason (none is ever recorded)."""
    return _STATUS_OF_REASON.get(finish.reason, RequestStatus.FINISHED_ABORTED)


def plan_entry(slot: int, key: int) -> int:
    """One plan word: the request's key and its slot."""
    return (key << 16) | slot


def split_plan_entry(entry: int) -> tuple[int, int]:
    """(slot, key) of one plan word."""
    return entry & 0xFFFF, entry >> 16


@dataclass
class _Ticket:
    """This engine's view of one lockstep request."""

    slot: int
    key: int
    stops: tuple[str, ...]
    min_tokens: int
    scheduled: bool = False
    """It reached the model runner, so the processor (not the scheduler) releases it."""
    watch: StopStringWatch | None = None
    """The leader's stop-string state of this request: it goes with the ticket when the request ends."""
    group: int = 0
    """Its diverse group (``RowSampling.group`` where the sample is diverse), else 0."""
    group_size: int = 1
    """The members of its group."""
    arrived_at: float = 0.0
    """``time.monotonic()`` when it reached this scheduler's queue."""

    @property
    def entry(self) -> int:
        return plan_entry(self.slot, self.key)


class LockstepScheduler(Scheduler):
    """What the leader and the followers share: tickets, arrival, finishing requests in vLLM, queue masking, the
    parent watch."""

    leads: ClassVar[bool]
    """The leader's scheduler (it plans), or a follower's."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        config = LockstepConfig.from_vllm(vllm_config, self.leads, type(self).__name__)
        self.role, self.position = config.role, config.position
        self.writer = Writer.SCHEDULER.at(self.position)
        self.session = SyncSession.attach(config.session)
        check_roster(config, self.session)
        self.session.names = config.roster
        self.sync_timeout = config.sync_timeout
        self.tickets: dict[str, _Ticket] = {}
        self._ending_outputs: list[tuple[int, EngineCoreOutput]] = []
        """Outputs of requests ended outside update_from_output, sent with the next step's outputs."""
        self._budget = min(self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens)
        self._kept: set[str] = set()
        """Requests preempted by the KV-cache reset of ``pause(mode="keep")``: taken again, not failed."""
        # Exit this engine if the driver dies, instead of waiting on it for ever (a forked engine watches from its
        # start already, a spawned one from here).
        session = self.session
        watch_driver(int(session.header[Header.OWNER_PID]), needed=lambda: not session.closed)

    # ------------------------------------------------------------------ vLLM interface

    def add_request(self, request: Request) -> None:
        pairing = request_pairing(request.sampling_params, self.role)
        sampling = pairing.get("sampling", {})
        diverse = sampling.get("diversity_penalty", 0) > 0 and sampling.get("group", 0) != 0
        ticket = _Ticket(
            int(pairing["slot"]),
            int(pairing["key"]),
            tuple(pairing.get("stop") or ()),
            int(sampling.get("min_tokens", 0)),
            group=int(sampling["group"]) if diverse else 0,
            group_size=int(sampling.get("group_size", 1)) if diverse else 1,
            arrived_at=time.monotonic(),
        )
        super().add_request(request)
        self.tickets[request.request_id] = ticket
        self.session.control[ticket.slot, slot_word(ModelSlot.ARRIVED, self.position)] = ticket.key
        self.on_arrival()

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        # vLLM's own aborts (a client that went away, an engine shutting down a request) reach one engine
        # only, at a step of its choosing. A lockstep request is instead ended by the leader on every engine.
        if finished_status != RequestStatus.FINISHED_ABORTED or request_ids is None or self.session.is_shut_down:
            return super().finish_requests(request_ids, finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            ticket = self.tickets.get(rid)
            if ticket is not None:
                self.session.request_abort(ticket.slot, ticket.key, self.writer)
        others = [rid for rid in ids if rid not in self.tickets]
        return super().finish_requests(others, finished_status) if others else []

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.after_step(scheduler_output, outputs)
        for client, output in self._ending_outputs:
            outputs.setdefault(client, EngineCoreOutputs()).outputs.append(output)
        self._ending_outputs.clear()
        for rid in [rid for rid in self.tickets if rid not in self.requests]:
            del self.tickets[rid]  # ended by vLLM's own stop checks (EOS, stop ids, length)
        return outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        # vLLM's pause with keep resets the cache with its running requests preempted: on every engine at once, since
        # the driver holds them all first, so those preemptions keep the engines in step.
        if reset_running_requests:
            self._kept.update(r.request_id for r in self.running if r.request_id in self.tickets)
        return super().reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        super().shutdown()
        self.session.close()

    # ------------------------------------------------------------------ for subclasses

    def on_arrival(self) -> None:
        """Called after a request was queued and marked arrived."""

    def after_step(self, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Called after vLLM processed a step's output."""

    def _end(
        self,
        request: Request,
        ticket: _Ticket,
        finish: Finish,
        *,
        error: ErrorCode = ErrorCode.NONE,
        stop_index: int = -1,
    ) -> None:
        """This role's one way to end a lockstep request, for ``finish`` (with ``error`` if it failed)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def _end_in_vllm(
        self,
        request: Request,
        ticket: _Ticket,
        finish: Finish,
        stop_index: int = -1,
        output: EngineCoreOutput | None = None,
    ) -> None:
        """Finish ``request`` in this engine now, with vLLM's status for ``finish``.

        Its frontend hears of it through ``output`` (its output of this step) if given, else with the next
        step's outputs. Only the roles' ``_end`` call this: it records nothing in the slot.
        """
        status = _status_of(finish)
        stop_reason = ticket.stops[stop_index] if 0 <= stop_index < len(ticket.stops) else None
        self.tickets.pop(request.request_id, None)
        self._kept.discard(request.request_id)
        Scheduler.finish_requests(self, request.request_id, status)
        if not ticket.scheduled:
            self.session.release(ticket.slot, ticket.key, self.position)  # no processor ever saw it
        if output is not None:
            output.finish_reason = RequestStatus.get_finished_reason(status)
            output.stop_reason = stop_reason
            return
        self._ending_outputs.append(
            (
                request.client_index,
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=RequestStatus.get_finished_reason(status),
                    stop_reason=stop_reason,
                ),
            )
        )

    def live_requests(self) -> list[tuple[Request, _Ticket]]:
        """Every lockstep request this engine holds and has not ended, running or waiting."""
        return [
            (self.requests[rid], t)
            for rid, t in self.tickets.items()
            if rid in self.requests and not self.requests[rid].is_finished()
        ]

    @contextlib.contextmanager
    def queue_only(self, admit: list[Request]) -> Iterator[None]:
        """Show vLLM's scheduler only ``admit`` as waiting requests; the others keep their places."""
        order = {id(r): n for n, r in enumerate(self.waiting)}
        chosen = {id(r) for r in admit}
        held = [r for r in self.waiting if id(r) not in chosen]
        self.waiting.remove_requests(held)
        try:
            yield
        finally:
            rest = list(self.waiting) + held
            rest.sort(key=lambda r: order.get(id(r), -1))  # preempted requests (unknown order) go first
            self.waiting.clear()
            self.waiting.extend(rest)

    def mark_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        for rid in scheduler_output.num_scheduled_tokens:
            ticket = self.tickets.get(rid)
            if ticket is not None:
                ticket.scheduled = True
            self._kept.discard(rid)

    @property
    def paused_with_keep(self) -> bool:
        """vLLM paused this engine with ``keep``: it still steps while it has ended requests to report (the pause
        completes once it is idle), with a token budget of 0, so no running request may be judged by such a step."""
        return self.pause_state == PauseState.PAUSED_ALL

    def held_output(self) -> SchedulerOutput:
        """A step that runs nothing and reports the requests ended meanwhile: while vLLM pauses this engine with
        ``keep``, or while the driver holds the engines and pauses this one next (then after a short wait, so that
        the EngineCore reads the pause without spinning)."""
        seen = self.session.bell_value(Bell.PLAN)
        if self.session.held and not self.paused_with_keep:
            self.session.wait_bell(Bell.PLAN, seen, IDLE_WAIT_S)
        out = SchedulerOutput.make_empty()
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()  # the runner drops their rows
        return out

    def refuse_preemptions(self, scheduler_output: SchedulerOutput) -> int:
        """A preempted request would restart on one engine only: fail it instead. Return how many were."""
        refused = 0
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._kept:
                continue
            request, ticket = self.requests.get(rid), self.tickets.get(rid)
            if request is not None and not request.is_finished() and ticket is not None:
                self._end(request, ticket, Finish.ERROR, error=ErrorCode.PREEMPTED)
                refused += 1
        return refused


class LeaderScheduler(LockstepScheduler):
    """The leader: decides admissions and endings, and publishes each step's plan."""

    leads = True

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        followers = range(1, self.session.layout.models)
        self._arrived = [slot_word(ModelSlot.ARRIVED, p) for p in followers]
        self._prompt_lens = [slot_word(ModelSlot.PROMPT_LEN, p) for p in followers]
        self.plans_published = 0
        self._group_admitted: dict[int, int] = {}
        """Per diverse group, how many of its members were admitted so far."""
        # Loaded now, not inside the first step that meets a stop string (seconds, with every request waiting): the
        # one vLLM's structured-output manager took from its cache as this EngineCore started, under this engine's
        # own settings; the folder's where the engine loads none (skip_tokenizer_init, as simulated engines run).
        model = vllm_config.model_config
        self.tokenizer = (
            engine_tokenizer(model.tokenizer) if model.skip_tokenizer_init else cached_tokenizer_from_config(model)
        )

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self.paused_with_keep:
            return self.held_output()  # its running requests are held: none ends for not being scheduled
        self._end_requested()
        admit = self._admissible()
        if not admit and not self.running:
            admit = self._await_admissible()
        with self.queue_only(admit):
            out = super().schedule(throttle_prefills)
        refused = self.refuse_preemptions(out)
        if refused:
            self.session.add_stat(Stat.PREEMPTIONS_REFUSED, refused)
        self._end_unscheduled(out)
        self.mark_scheduled(out)
        if out.num_scheduled_tokens:
            self._publish(out)
        return out

    def after_step(self, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]) -> None:
        by_id = {o.request_id: o for eco in outputs.values() for o in eco.outputs}
        for rid in scheduler_output.num_scheduled_tokens:
            ticket, request, output = self.tickets.get(rid), self.requests.get(rid), by_id.get(rid)
            if ticket is None:
                continue
            if request is None or request.is_finished():
                # vLLM's stop checks ended it; the followers' identical checks end it at the same step.
                reason = output.finish_reason if output is not None else None
                self._end(request, ticket, (reason is not None and Finish.of_reason(str(reason))) or Finish.STOP)
            elif self.session.error(ticket.slot)[0] != ErrorCode.NONE:
                self._end(request, ticket, Finish.ERROR, output=output)
            elif ticket.stops and request.num_output_tokens >= ticket.min_tokens:
                try:
                    ticket.watch = ticket.watch or StopStringWatch(self.tokenizer, ticket.stops)
                    index = ticket.watch.check(request.output_token_ids)
                except Exception:
                    # This request's stop strings (or its tokens) broke the check: it fails, the engine goes on.
                    logger.exception("checking the stop strings of request %s failed; it fails alone", rid)
                    self._end(request, ticket, Finish.ERROR, error=ErrorCode.DECISION_ERROR, output=output)
                    continue
                if index is not None:
                    self._end(request, ticket, Finish.STOP_STRING, stop_index=index, output=output)

    # ------------------------------------------------------------------ admission

    def _arrived_everywhere(self, ticket: _Ticket) -> bool:
        """The request sits in every follower's queue too."""
        c = self.session.control[ticket.slot]
        return all(int(c[word]) == ticket.key for word in self._arrived)

    def _costs(self, request: Request, ticket: _Ticket) -> list[int]:
        """The request's prefill on each engine, in roster order (the followers' from their prompt lengths, 0 on one
        the request leaves out); a request a ``keep`` pause preempted prefills its generated tokens too."""
        c = self.session.control[ticket.slot]
        generated = request.num_output_tokens
        lengths = (int(c[word]) for word in self._prompt_lens)
        return [request.num_prompt_tokens + generated, *(n + generated if n else 0 for n in lengths)]

    def _admissible(self) -> list[Request]:
        """Waiting requests to admit now: first come first served, while seats and every engine's budget last."""
        seats = self.max_num_running_reqs - len(self.running)
        # Each running request decodes one token on every engine.
        budgets = [self._budget - len(self.running)] * self.session.layout.models
        admit: list[Request] = []
        waiting = list(self.waiting)
        held: set[int] = set()  # groups checked, whole or waited for long enough
        for index, request in enumerate(waiting):
            ticket = self.tickets.get(request.request_id)
            if ticket is None:
                continue
            if not self._arrived_everywhere(ticket):
                break  # strictly in arrival order: it reaches the followers shortly
            if ticket.group and ticket.group not in held:
                if not self._group_ready(waiting[index:], ticket, seats, budgets):
                    break
                held.add(ticket.group)
            costs = self._costs(request, ticket)
            if seats <= 0 or any(cost > budget for cost, budget in zip(costs, budgets)):
                break
            admit.append(request)
            seats, budgets = seats - 1, [budget - cost for budget, cost in zip(budgets, costs)]
            if ticket.group and request.request_id not in self._kept:  # a held member was counted when first admitted
                self._group_admitted[ticket.group] = self._group_admitted.get(ticket.group, 0) + 1
                while len(self._group_admitted) > MAX_TRACKED_GROUPS:
                    del self._group_admitted[next(iter(self._group_admitted))]
        return admit

    def _group_ready(self, waiting: list[Request], first: _Ticket, seats: int, budgets: list[int]) -> bool:
        """Whether to admit the diverse group of ``first`` (the head of ``waiting``) now: all its members not yet
        admitted have arrived on every engine and fit together, or its first member waited :data:`GROUP_WAIT_S`."""
        missing = first.group_size - self._group_admitted.get(first.group, 0)
        if time.monotonic() - first.arrived_at >= GROUP_WAIT_S or missing > self.max_num_running_reqs:
            return True  # waited long enough, or the group can never run at once
        members = [
            (r, t)
            for r in waiting
            if (t := self.tickets.get(r.request_id)) is not None
            and t.group == first.group
            and self._arrived_everywhere(t)
        ]
        costs = [sum(engine) for engine in zip(*(self._costs(r, t) for r, t in members))] or [0] * len(budgets)
        fits = len(members) <= seats and all(cost <= budget for cost, budget in zip(costs, budgets))
        return len(members) >= missing and fits

    def _await_admissible(self) -> list[Request]:
        """Nothing runs: wait (briefly) for a partner's arrival or an abort instead of stepping an empty batch."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while True:
            seen = self.session.bell_value(Bell.TO_LEADER)
            self._end_requested()
            admit = self._admissible()
            remaining = deadline - time.monotonic()
            if admit or not self.waiting or remaining <= 0 or self.session.is_shut_down:
                return admit
            self.session.wait_bell(Bell.TO_LEADER, seen, remaining)

    def _publish(self, out: SchedulerOutput) -> None:
        number = self.plans_published
        control = self.session.control
        admitted = 0
        for new in out.scheduled_new_reqs:
            ticket = self.tickets[new.req_id]
            control[ticket.slot, Slot.ADMIT_PLAN] = number
            control[ticket.slot, Slot.PHASE] = Phase.RUNNING
            admitted += 1
        self.session.publish_plan(number, [self.tickets[rid].entry for rid in out.num_scheduled_tokens])
        self.plans_published = number + 1
        self.session.add_stat(Stat.LEADER_ADMITTED, admitted)

    # ------------------------------------------------------------------ endings

    def _end_requested(self) -> None:
        """End what was aborted, or failed on any engine, before the next plan."""
        for request, ticket in self.live_requests():
            if self.session.abort_requested(ticket.slot, ticket.key):
                self._end(request, ticket, Finish.ABORT)
            elif request.status == RequestStatus.RUNNING and self.session.error(ticket.slot)[0] != ErrorCode.NONE:
                self._end(request, ticket, Finish.ERROR)

    def _end_unscheduled(self, out: SchedulerOutput) -> None:
        """A running request left out of a step would run one step behind the followers' copies: fail it."""
        for request in list(self.running):
            ticket = self.tickets.get(request.request_id)
            if ticket is not None and request.request_id not in out.num_scheduled_tokens:
                self._end(request, ticket, Finish.ERROR, error=ErrorCode.DIVERGED)

    def _end(
        self,
        request: Request | None,
        ticket: _Ticket,
        finish: Finish,
        *,
        error: ErrorCode = ErrorCode.NONE,
        stop_index: int = -1,
        output: EngineCoreOutput | None = None,
    ) -> None:
        """The leader's one ending: record ``finish`` in the request's slot, then end it here.

        With ``error`` the request failed here: the code goes to its slot first, so its processors
        abandon its rows. The record (FINISH, STOP_INDEX and FINISH_PLAN, announced by PHASE) is what
        the follower ends the request by, before running plan FINISH_PLAN, and what the driver reports.
        A request that vLLM's own stop checks ended (``request`` None or finished) is only recorded:
        the followers' identical checks end it there at the same step. ``output``, the request's output of
        this step if it has one, carries the ending to the frontend.
        """
        if error != ErrorCode.NONE:
            self.session.fail_slot(ticket.slot, ticket.key, error, request.num_output_tokens, self.writer)
        c = self.session.control[ticket.slot]
        if int(c[Slot.KEY]) == ticket.key and int(c[Slot.PHASE]) != Phase.FINISHED:
            c[Slot.FINISH], c[Slot.STOP_INDEX], c[Slot.FINISH_PLAN] = finish, stop_index, self.plans_published
            c[Slot.PHASE] = Phase.FINISHED  # last: it announces the fields above
            self.session.ring(Bell.PLAN, self.writer)
        if request is None or request.is_finished():
            return
        self.session.add_stat(Stat.LEADER_ENDED, 1)
        self._end_in_vllm(request, ticket, finish, stop_index, output)


class FollowerScheduler(LockstepScheduler):
    """A follower: runs exactly the leader's plan at every step."""

    leads = False

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.plans_consumed = 0

    def on_arrival(self) -> None:
        self.session.ring(Bell.TO_LEADER, self.writer)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self.paused_with_keep:
            self._follow_endings(self.plans_consumed)
            return self.held_output()
        number, plan = self._await_plan(self.plans_consumed)
        if plan is None and self._hold_reached(number):
            return self.held_output()
        admit = [] if plan is None else self._apply_plan(number, plan)
        # Without a plan nothing runs here: _await_plan returns None only once no request is running.
        with self.queue_only(admit):
            out = super().schedule(throttle_prefills)
        if plan is not None:
            self.refuse_preemptions(out)
            self._check_batch(out, plan)
            number += 1
        self.plans_consumed = number  # the plans passed over (_skip_plans) count as consumed too
        self.session.model_words[self.position, ModelWord.PLANS_CONSUMED] = number
        self.mark_scheduled(out)
        return out

    # ------------------------------------------------------------------ plans

    def _await_plan(self, number: int) -> tuple[int, list[int] | None]:
        """The next plan to run from ``number`` on, with its number; (the number to look at next, None) if none is
        there and nothing here runs (after a short wait) or it never came. While nothing runs here, plans that name
        none of this engine's requests are passed over (:meth:`_skip_plans`)."""
        s = self.session
        start = time.monotonic()
        deadline = start + self.sync_timeout
        try:
            while True:
                seen = s.bell_value(Bell.PLAN)
                if not self.running:
                    number = self._skip_plans(number)
                plan = s.read_plan(number)
                if plan is not None:
                    return number, plan
                self._follow_endings(number)  # before a hold too: a held engine ends what the leader ended
                if self._hold_reached(number):
                    return number, None
                now = time.monotonic()
                if s.is_shut_down:
                    for request, ticket in self.live_requests():
                        self._end(request, ticket, Finish.ERROR, error=ErrorCode.SHUTDOWN)
                    return number, None
                if not self.running:
                    if now - start >= IDLE_WAIT_S:
                        return number, None
                    s.wait_bell(Bell.PLAN, seen, IDLE_WAIT_S - (now - start))
                    continue
                if now >= deadline:
                    logger.error(
                        "no plan %d from the leader engine within %.0f s; failing %d running requests",
                        number,
                        self.sync_timeout,
                        len(self.running),
                    )
                    for request in list(self.running):
                        ticket = self.tickets.get(request.request_id)
                        if ticket is not None:
                            self._end(request, ticket, Finish.ERROR, error=ErrorCode.SYNC_TIMEOUT)
                    return number, None
                s.wait_bell(Bell.PLAN, seen, min(deadline - now, WAIT_CAP_S))
        finally:
            s.add_model_stat(self.position, ModelWord.PLAN_WAIT_NS, int((time.monotonic() - start) * 1e9))

    def _hold_reached(self, number: int) -> bool:
        """The driver holds the engines and this engine ran every plan published before the hold (``number`` is the
        next it would run)."""
        before = self.session.plans_before_hold()
        return before is not None and number >= before

    def _skip_plans(self, number: int) -> int:
        """The first plan from ``number`` on that may concern this engine, which runs nothing now.

        Where requests leave teachers out (:attr:`Slot.PARTICIPANTS`), the leader steps on without a follower that
        runs none of them, and the plan ring moves past it. Each plan published since that names no request of this
        engine is passed over, and so is one the ring overwrote: a plan that admits a request of this engine is kept
        until this engine has run it, since the leader's step on it waits for this engine's row.
        """
        s = self.session
        published = int(s.header[Header.PLANS_PUBLISHED])
        number = max(number, published - PLAN_RING)  # the ring holds the last PLAN_RING plans only
        held = {ticket.entry for ticket in self.tickets.values()}
        while number < published:
            plan = s.read_plan(number)
            if plan is not None and any(entry in held or self._takes_part(entry) for entry in plan):
                break
            number += 1
        return number

    def _takes_part(self, entry: int) -> bool:
        """Whether this engine runs the request of a plan entry (it was named among the request's participants)."""
        slot, key = split_plan_entry(entry)
        return self.session.takes_part(slot, key, self.position)

    def _follow_endings(self, number: int) -> None:
        """End every request the leader ended before plan ``number`` (or dropped before admitting it)."""
        control = self.session.control
        for request, ticket in self.live_requests():
            c = control[ticket.slot]
            if int(c[Slot.KEY]) != ticket.key or int(c[Slot.PHASE]) != Phase.FINISHED:
                continue
            if int(c[Slot.ADMIT_PLAN]) < 0 or int(c[Slot.FINISH_PLAN]) <= number:
                self._end(request, ticket, Finish(int(c[Slot.FINISH])), stop_index=int(c[Slot.STOP_INDEX]))

    def _apply_plan(self, number: int, plan: list[int]) -> list[Request]:
        """End running requests the plan leaves out; return the waiting requests it admits."""
        self._follow_endings(number)
        members = set(plan)
        for request in list(self.running):
            ticket = self.tickets.get(request.request_id)
            if ticket is not None and ticket.entry not in members:
                # The leader ended it, but said nothing before this plan.
                self.session.add_model_stat(self.position, ModelWord.DIVERGED, 1)
                self._end(request, ticket, Finish.ERROR, error=ErrorCode.DIVERGED)
        by_entry = {t.entry: (self.requests.get(rid), t) for rid, t in self.tickets.items()}
        running = {id(r) for r in self.running}
        admit = []
        for entry in plan:
            request, ticket = by_entry.get(entry, (None, None))
            if request is not None and id(request) in running:
                continue
            if request is None and not self._takes_part(entry):
                continue  # a request that leaves this model out: its engine never receives it
            kept = request is not None and request.request_id in self._kept
            if request is None or not (request.status == RequestStatus.WAITING or kept):
                # Not here, or not waiting: its slot gets the error even when this engine holds no request for it.
                slot, key = split_plan_entry(entry)
                self.session.fail_slot(slot, key, ErrorCode.DIVERGED, 0, self.writer)
                self.session.add_model_stat(self.position, ModelWord.DIVERGED, 1)
                if request is not None:
                    self._end(request, ticket, Finish.ERROR)
                continue
            admit.append(request)
        return admit

    def _check_batch(self, out: SchedulerOutput, plan: list[int]) -> None:
        """Every plan entry this engine holds must be in its batch; one that is not fails alone."""
        members = set(plan)
        scheduled = {self.tickets[rid].entry for rid in out.num_scheduled_tokens if rid in self.tickets}
        for request, ticket in self.live_requests():
            if ticket.entry in members and ticket.entry not in scheduled:
                self.session.add_model_stat(self.position, ModelWord.DIVERGED, 1)
                self._end(request, ticket, Finish.ERROR, error=ErrorCode.DIVERGED)

    # ------------------------------------------------------------------ endings

    def _end(
        self,
        request: Request,
        ticket: _Ticket,
        finish: Finish,
        *,
        error: ErrorCode = ErrorCode.NONE,
        stop_index: int = -1,
    ) -> None:
        """The follower's one ending: end ``request`` here as the leader recorded it (``finish``, ``stop_index``).

        With ``error`` (and ``Finish.ERROR``) it failed on this side: the code goes to its slot first,
        and the leader, seeing it, ends the request on its engine and records the end.
        """
        if error != ErrorCode.NONE:
            self.session.fail_slot(ticket.slot, ticket.key, error, request.num_output_tokens, self.writer)
        self._end_in_vllm(request, ticket, finish, stop_index)
