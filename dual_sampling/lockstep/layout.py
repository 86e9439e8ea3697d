"""The shared memory of one lockstep session: its layout, who writes what, and the waits.

One session is one file in /dev/shm, mapped by the driver and by two plugins inside each
engine of the run's roster (``dual_sampling.roster``): the engine's scheduler
(``processors.scheduler``, in the EngineCore process) and its logits processor
(``processors.leader`` for the leader, ``processors.follower`` for a follower, in the worker
process). Models are indexed by roster *position*: 0 is the leader, the model whose engine
decides; every other position follows. It holds:

- a header: sizes, the owner's pid, the shutdown word, the plan counter and statistics;
- per model: its counters (:class:`ModelWord`), a row each;
- doorbells: 32-bit futex words, one per direction of waiting;
- the plan ring: the leader scheduler's list of request keys for each engine step;
- per request *slot*: control words (:class:`Slot`, then :class:`ModelSlot` per model), each
  follower's log-probability row for the current step, the per-token records the leader's
  processor writes, and (for requests that ask) q's most likely tokens at each step.

Roles and the words they write (:data:`WRITERS` and :data:`MODEL_WRITERS` are the table;
``docs/architecture.md`` has the argument for why lockstep holds):

- the **driver** opens and closes slots and asks for aborts;
- the **leader scheduler** decides every change of batch membership: it admits, publishes
  each step's plan, and ends requests (aborts, stop strings, errors);
- each **follower scheduler** marks arrivals and runs exactly each plan;
- the **processors** exchange one logits row per follower and one token per request per step.

Every flag that a late writer could leave behind carries the request key it refers to,
so it can never mark a slot's next occupant. Doorbells are rung by *storing* a fresh
value (the writer's id and a counter), never by a read-modify-write, so several writers
cannot lose a wake. Waits block on a futex (Linux) with a cap, so a shutdown is seen
within the cap even without a wake. Lockstep relies on stores becoming visible in program
order, which x86-64 guarantees; on other architectures ``SyncSession.create`` refuses
to start rather than run without fences.

Cleanup after a crash is :mod:`dual_sampling.lockstep.janitor`.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from dual_sampling.checks import need_int
from dual_sampling.roster import TOKEN_COLUMNS, token_column_count

SHM_DIR = Path("/dev/shm")
SESSION_PREFIX = "dual-sampling-"
MiB = 1 << 20
MAGIC = 0x44554136  # "DUA6"; a session written by an older layout is refused, never misread
PLAN_RING = 4
"""Plans kept at once. The leader is at most one plan ahead of a follower that runs one of its requests (its step needs
that follower's rows); an idle follower passes over the plans it missed (``FollowerScheduler._skip_plans``)."""
RECORD_FIELDS = TOKEN_COLUMNS
"""Columns of the two-model roster's per-token records (float32), in order (:mod:`dual_sampling.roster`); a session
of more models has :func:`~dual_sampling.roster.token_column_count` columns, in its roster's order."""
MAX_MODELS = 16
"""Models one session holds at most (a writer's id, with its position, fits a doorbell's top byte)."""
TOP_LOGPROBS_MAX = 20
"""Most likely tokens of q recorded per token at most, for requests that ask (OpenAI's limit)."""


class SyncError(RuntimeError):
    """The two engines could not be kept in lockstep, or an engine failed.

    Callers that act on the failure catch one of its two kinds: :class:`RequestFailed` (retry the request) or
    :class:`EnginePairDead` (restart the pair). A plain SyncError is raised before a pair runs (a host or a
    shared-memory folder that cannot hold a session).
    """


class RequestFailed(SyncError):
    """One request failed (its engine call raised, or it ended without an output); the pair serves on: retry it."""


class EnginePairDead(SyncError):
    """The pair can serve nothing more (an engine died or stalled, a weight load failed, or it was closed): restart
    it. Every request in flight or queued when it happened fails with the same error."""


class Header(IntEnum):
    """Header words (int64)."""

    MAGIC = 0
    VOCAB = 1
    SLOTS = 2
    MAX_STEPS = 3
    PLAN_WIDTH = 4
    OWNER_PID = 5
    """The driver's pid: engines exit when it dies; the next session removes the file."""
    SHUTDOWN = 6
    """Non-zero: every wait ends and every row is abandoned."""
    PLANS_PUBLISHED = 7
    """Leader scheduler: plans published so far (the next plan's number)."""
    MODELS = 8
    """Models in the roster: the leader at position 0, the followers after it."""
    OWNER_START = 10
    """The driver's start time, in clock ticks after boot: with OWNER_PID it names one process, pid reuse or not."""
    OWNER_PID_NS = 11
    """Inode of the driver's PID namespace: OWNER_PID means nothing in another namespace. 0 in older versions' files."""
    OWNER_BOOT = 12
    """The first 60 bits of the boot id the driver ran under."""
    DENSE_K = 13
    """Top-k log-probabilities of each model's own distribution recorded per token at most (0: none)."""
    HOLD = 14
    """Driver, for ``pause(mode="keep")``: 1 + the plans the leader published before its engine was paused (none
    follows), 0 without a hold. Each follower runs those plans, then steps nothing until the driver pauses it."""


STATS_BASE = 16


class Stat(IntEnum):
    """Statistics words (int64) in the header after the fixed words; each has one writer. Per-model counters are
    :class:`ModelWord`."""

    MIX_NS = STATS_BASE
    SPLIT_STEPS = STATS_BASE + 1
    """Leader steps whose followers' rows arrived in more than one round: batches out of phase, 0 by construction
    where every request runs on every follower (requests that name some teachers only are decided as their teachers'
    rows come, which may take rounds)."""
    LEADER_ADMITTED = STATS_BASE + 2
    LEADER_ENDED = STATS_BASE + 3
    """Requests the leader scheduler ended itself: aborts, stop strings, errors."""
    PREEMPTIONS_REFUSED = STATS_BASE + 4
    DRAFTED = STATS_BASE + 5
    """Theta's drafts the teacher checked against q (``mode="speculative"``; written by its sampling step): those up
    to and including each round's first rejection (the drafts after it are never looked at)."""
    ACCEPTED = STATS_BASE + 6
    """Of those, the drafts kept; accepted / drafted estimates the per-position acceptance Σ min(π_θ, q)."""
    KERNEL_HANDED_BACK = STATS_BASE + 7
    """Rows a fused decision kernel handed to the torch reference (``Decision.handed_back``): a row outside the
    kernel's domain, or one whose α solve did not converge in its passes."""
    KERNEL_UNCONVERGED = STATS_BASE + 8
    """Of those, the rows whose α solve did not converge in the kernel (``Decision.unconverged``)."""


class ModelWord(IntEnum):
    """Per-model words (int64), one row of :data:`MODEL_WORDS` per roster position; each is written by that model's
    own plugins. Those with :attr:`reported` are statistics: ``<model name>_<word>`` (``teacher_rows``, ...)."""

    ROWS = 0
    """Processor: rows it served (the leader: decided; a follower: published)."""
    WAIT_NS = 1
    """Processor: time it waited for its partners (the leader: for the followers' rows, minus its mixing)."""
    STEPS = 2
    TIMEOUTS = 3
    ABANDONED = 4
    PLAN_WAIT_NS = 5
    """Follower scheduler: time it waited for the leader's plan (reported summed: ``follower_plan_wait_ns``)."""
    DIVERGED = 6
    """Follower scheduler: plan entries it could not run, each failing its request alone (``follower_diverged``)."""
    PLANS_CONSUMED = 7
    """Follower scheduler: plans it has run so far."""
    PUBLICATIONS = 8
    """Follower processor: a sequence word, odd while it stores one step's rows and step words, even otherwise."""

    @property
    def reported(self) -> str | None:
        """The statistic's name suffix, or ``follower_*`` for those summed over followers; None for protocol words."""
        if self in (ModelWord.PLANS_CONSUMED, ModelWord.PUBLICATIONS):
            return None
        return self.name.lower()

    @property
    def summed(self) -> bool:
        """Reported as one sum over the followers (``follower_<name>``), not per model."""
        return self in (ModelWord.PLAN_WAIT_NS, ModelWord.DIVERGED)


MODEL_WORDS = 16  # 128 bytes per model: two cache lines, none shared with another model's writers


HEADER_WORDS = 64


class Bell(IntEnum):
    """Doorbells (int32 futex words), one per direction of waiting; a ring wakes every waiter."""

    ROWS = 0
    """Followers' processors -> leader's processor: rows published."""
    TOKENS = 1
    """Leader's processor -> followers' processors: tokens decided."""
    PLAN = 2
    """Leader scheduler -> follower schedulers: a plan or an ending published. The driver rings it after a submit."""
    TO_LEADER = 3
    """Follower schedulers (arrivals) and driver (submits, aborts) -> leader scheduler."""


BELL_WORDS = 16  # 64 bytes: their own cache line


class Writer(IntEnum):
    """What rings a bell: with its roster position (:meth:`at`) part of the value stored, so two writers never store
    the same value."""

    DRIVER = 1
    SCHEDULER = 2
    PROCESSOR = 3

    def at(self, position: int) -> int:
        """This plugin's id at roster ``position`` (the driver's is its kind alone)."""
        return int(self) if self is Writer.DRIVER else int(self) + 4 * position


class Slot(IntEnum):
    """Per-slot control words (int64) of the request, before each model's :class:`ModelSlot` words."""

    KEY = 0
    """Driver: the occupying request's key (> 0); -key once the driver has read the slot; 0 never used."""
    ABORT = 1
    """Driver, or any scheduler turning a vLLM abort into a lockstep one: key of the request to end."""
    PHASE = 2
    """Leader scheduler: :class:`Phase` of the occupying request."""
    ADMIT_PLAN = 3
    """Leader scheduler: number of the first plan that holds the request."""
    FINISH_PLAN = 4
    """Leader scheduler: number of the first plan that no longer holds it."""
    FINISH = 5
    """Leader scheduler: :class:`Finish` reason."""
    STOP_INDEX = 6
    """Leader scheduler: index of the stop string that ended it, else -1."""
    DECIDED_STEP = 7
    """Leader processor: step of the token in ``TOKEN`` (written after the token and records)."""
    TOKEN = 8
    NUM_RECORDS = 9
    ERROR = 10
    """The request's error: ``code | step << 8`` in one store (:meth:`SyncSession.fail_slot`); 0 if none."""
    PARTICIPANTS = 11
    """Driver: the roster positions whose engines run the request, one bit each (the leader's always set). A model
    left out never receives it: the driver marks it arrived and released when it opens the slot."""


class ModelSlot(IntEnum):
    """Per-slot control words (int64) of one model, at :func:`slot_word` for its roster position."""

    PROMPT_LEN = 0
    """Driver: the model's prompt length, so the leader scheduler can budget every engine's prefill."""
    ARRIVED = 1
    """The model's scheduler: key of the request once it sits in that scheduler's queue."""
    RELEASED = 2
    """Key of the request the model's engine no longer touches (its processor saw it leave, or it never ran)."""
    ROW_STEP = 3
    """A follower's processor: step of the row in its ``follower_logprobs`` (and log-normaliser), written after
    them. Unused for the leader."""


SLOT_WORDS = 12
"""Words of :class:`Slot`; each model's :class:`ModelSlot` words follow them."""
MODEL_SLOT_WORDS = 4


def slot_word(word: ModelSlot, position: int) -> int:
    """Index in a slot's control row of model ``position``'s ``word``."""
    return SLOT_WORDS + MODEL_SLOT_WORDS * position + int(word)


class Phase(IntEnum):
    """Life of a request in its slot, as the leader scheduler decides it."""

    EMPTY = 0
    SUBMITTED = 1
    """Opened by the driver; not yet in any plan."""
    RUNNING = 2
    """In every plan from ADMIT_PLAN on."""
    FINISHED = 3
    """In no plan from FINISH_PLAN on (ADMIT_PLAN = -1: never admitted)."""


class Finish(IntEnum):
    """Why a request ended (the leader scheduler's word on it).

    The one table of endings: :attr:`reason` is the finish reason that the driver reports and
    from which the engine plugins take vLLM's request status.
    """

    NONE = 0
    STOP = 1
    """An EOS or a stop token id."""
    STOP_STRING = 2
    LENGTH = 3
    ABORT = 4
    ERROR = 5

    @property
    def reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (vLLM's and OpenAI's words); None for NONE."""
        return _FINISH_REASON.get(self)

    @classmethod
    def of_reason(cls, reason: str) -> Finish | None:
        """The first ending with this finish reason (``"stop"`` gives STOP); None for a reason of no ending here."""
        return next((f for f in cls if f.reason == reason), None)


_FINISH_REASON = {
    Finish.STOP: "stop",
    Finish.STOP_STRING: "stop",
    Finish.LENGTH: "length",
    Finish.ABORT: "abort",
    Finish.ERROR: "error",
}


class ErrorCode(IntEnum):
    """Why a request failed; stored in :attr:`Slot.ERROR`."""

    NONE = 0
    SYNC_TIMEOUT = 1
    """A processor waited longer than sync_timeout for its partner."""
    BAD_LOGITS = 2
    """NaN or +inf logits, or nothing left to sample."""
    PREEMPTED = 3
    """An engine tried to preempt the request (its KV cache ran out); refused."""
    DIVERGED = 4
    """The two engines' batches differed for this request; it could not be kept in lockstep."""
    SHUTDOWN = 5
    """The session shut down while the request ran."""
    DECISION_ERROR = 6
    """An exception in an engine's work for this request alone (deciding its token, publishing a follower's row,
    checking its stop strings); the engine logs it and serves the other requests."""
    NON_FINITE = 7
    """A decided token's α, log π_t, log π_θ or log q was not finite; nothing of it was recorded."""

    @property
    def label(self) -> str:
        return self.name.lower()


WRITERS: dict[Slot, tuple[str, ...]] = {
    Slot.KEY: ("driver",),
    # The driver's aborts and vLLM's own (which reach one engine's scheduler only) take one route,
    # SyncSession.request_abort, so the leader ends every abort in one place; all store the same key.
    Slot.ABORT: ("driver", "leader scheduler", "follower scheduler"),
    Slot.PHASE: ("leader scheduler",),
    Slot.ADMIT_PLAN: ("leader scheduler",),
    Slot.FINISH_PLAN: ("leader scheduler",),
    Slot.FINISH: ("leader scheduler",),
    Slot.STOP_INDEX: ("leader scheduler",),
    Slot.DECIDED_STEP: ("leader processor",),
    Slot.TOKEN: ("leader processor",),
    # In mode="speculative" the teacher engine's sampling step (processors.speculative) is the leader processor.
    Slot.NUM_RECORDS: ("leader processor",),
    # A request fails where its failure is seen: a processor in its row's work (bad logits, a timeout,
    # an exception), a scheduler in its batch (divergence, preemption, a stop-string check, no plan, a
    # shutdown), mostly inside its role's one ending. Every write is SyncSession.fail_slot: one store of
    # code and step, kept only if none is recorded.
    Slot.ERROR: ("leader processor", "follower processor", "leader scheduler", "follower scheduler"),
    Slot.PARTICIPANTS: ("driver",),
}
"""Which plugin writes each request word. Words with several writers are written by single stores of values that
agree. "follower" is any follower's.

Besides these, the driver resets every word of a free slot (:meth:`SyncSession.open_slot`) before it announces
the slot's next request.
"""

MODEL_WRITERS: dict[ModelSlot, tuple[str, ...]] = {
    ModelSlot.PROMPT_LEN: ("driver",),
    ModelSlot.ARRIVED: ("scheduler",),
    # On each engine, the processor releases a request that reached the model runner, the scheduler one that
    # never did: never both for one key. In mode="speculative" no plugin runs there: the driver releases both
    # once vLLM has ended the request (its final output came).
    ModelSlot.RELEASED: ("processor", "scheduler", "speculative driver"),
    ModelSlot.ROW_STEP: ("processor",),
}
"""Which plugin of the model's own engine writes each of its words (the driver excepted)."""


def check_host() -> None:
    """Refuse hosts whose memory model could reorder the protocol's plain stores."""
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in ("x86_64", "amd64"):
        raise SyncError(
            f"dual-sampling runs on Linux x86-64 only (this host: {platform.system()} {machine}): its shared-memory "
            "protocol relies on stores becoming visible in program order, which other architectures do not guarantee "
            "without fences"
        )


@dataclass(frozen=True)
class SessionLayout:
    """Sizes of one session's shared file; byte offsets are derived from them."""

    vocab: int
    """Tokens per logits row (the shared tokenizer's vocabulary, padding rows excluded)."""
    slots: int
    """Requests that can be submitted to the engines at once."""
    max_steps: int
    """Generated tokens recorded per request (at least max_model_len)."""
    plan_width: int
    """Requests per engine step at most (max_num_seqs)."""
    dense_k: int = 0
    """Per token, the teacher's and theta's own k most likely tokens recorded at most (0: no such region)."""
    models: int = 2
    """Models in the roster: one leader and ``models - 1`` followers."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            need_int(f.name, getattr(self, f.name), {"dense_k": 0, "models": 2}.get(f.name, 1))
        if self.models > MAX_MODELS:
            raise ValueError(f"models must be at most {MAX_MODELS}, got {self.models}")

    @staticmethod
    def header_word(name: str) -> Header:
        """The header word that holds field ``name`` (its name in capitals)."""
        return Header[name.upper()]

    @property
    def followers(self) -> int:
        return self.models - 1

    @property
    def control_words(self) -> int:
        """Words of one slot's control row: :class:`Slot`'s, then each model's, to a whole cache line."""
        return (slot_word(ModelSlot(0), self.models) + 7) // 8 * 8

    @property
    def record_width(self) -> int:
        """Columns of one token's record: the roster's (:func:`~dual_sampling.roster.token_column_count`)."""
        return token_column_count(self.models)

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each region, each aligned to a cache line, and the total size."""
        cells = self.max_steps * self.slots
        sizes = [
            ("header", 8 * HEADER_WORDS),
            ("model_words", 8 * MODEL_WORDS * self.models),
            ("bells", 4 * BELL_WORDS),
            ("plans", 8 * PLAN_RING * (2 + self.plan_width)),
            ("control", 8 * self.control_words * self.slots),
            ("follower_logprobs", 4 * self.followers * self.vocab * self.slots),
            # float64 per follower and slot: log Σ exp of the follower's raw logits row, stored with the row where a
            # repetition penalty needs the mixture's raw logits (written before ROW_STEP announces the row).
            ("follower_log_normalisers", 8 * self.followers * self.slots),
            ("tokens", 4 * cells),
            ("records", 4 * self.record_width * cells),
            ("top_ids", 4 * TOP_LOGPROBS_MAX * cells),
            ("top_logq", 4 * TOP_LOGPROBS_MAX * cells),
            # log π of each model at the same ids (the candidates a beam search extends by): [slot, step, model, k].
            ("top_logp", 4 * self.models * TOP_LOGPROBS_MAX * cells),
            # Each model's own top k, [slot, step, model, k], and every model's log π at them, [slot, step, model
            # (whose tokens), model (whose log π), k] (decision.result.dense_top).
            ("dense_ids", 4 * self.models * self.dense_k * cells),
            ("dense_logp", 4 * self.models * self.models * self.dense_k * cells),
        ]
        out, pos = {}, 0
        for name, size in sizes:
            out[name] = pos
            pos += (size + 63) // 64 * 64
        out["total"] = pos
        return out
