"""The shared memory of one dual-engine session: its layout, who writes what, and the waits.

One session is one file in /dev/shm, mapped by the driver and by four plugins inside the
two engines: each engine's scheduler (``processors.scheduler``, in the EngineCore process)
and each engine's logits processor (``processors.teacher`` / ``processors.theta``, in the
worker process). It holds:

- a header: sizes, the owner's pid, the shutdown word, plan counters and statistics;
- doorbells: 32-bit futex words, one per direction of waiting;
- the plan ring: the teacher scheduler's list of request keys for each engine step;
- per request *slot*: control words (:class:`Slot`), theta's log-probability row for the
  current step, the per-token records the teacher processor writes, and (for requests that
  ask) q's most likely tokens at each step.

Roles and the words they write (:data:`WRITERS` is the table; ``docs/architecture.md`` has
the argument for why lockstep holds):

- the **driver** opens and closes slots and asks for aborts;
- the **teacher scheduler** (the leader) decides every change of batch membership: it
  admits, publishes each step's plan, and ends requests (aborts, stop strings, errors);
- the **theta scheduler** (the follower) marks arrivals and runs exactly each plan;
- the **processors** exchange one logits row and one token per request per step.

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
from enum import Enum, IntEnum
from pathlib import Path
from typing import TypeVar

from dual_sampling.checks import need_int
from dual_sampling.roster import TOKEN_COLUMNS

T = TypeVar("T")
SHM_DIR = Path("/dev/shm")
SESSION_PREFIX = "dual-sampling-"
MiB = 1 << 20
MAGIC = 0x44554133  # "DUA3"; a session written by an older layout is refused, never misread
PLAN_RING = 4
"""Plans kept at once. The leader is at most one plan ahead of the follower (its step needs theta's rows)."""
RECORD_FIELDS = TOKEN_COLUMNS
"""Columns of the per-token records (float32), in order: the roster's (:mod:`dual_sampling.roster`)."""
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


class Role(str, Enum):
    """The two engines' roles; equal to (and printed as) their names, "teacher" and "theta", the form records,
    routes and JSON use."""

    TEACHER = "teacher"
    THETA = "theta"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{role}" is its name on every Python version

    @classmethod
    def parse(cls, value: object, name: str = "role") -> Role:
        """``value`` as a Role; ValueError naming ``name`` for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be 'teacher' or 'theta', got {value!r}") from None

    def pick(self, teacher: T, theta: T) -> T:
        """``teacher`` for the teacher, ``theta`` for theta (the one place a per-role pair of values is split)."""
        return teacher if self is Role.TEACHER else theta


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
    """Teacher scheduler: plans published so far (the next plan's number)."""
    PLANS_CONSUMED = 8
    """Theta scheduler: plans it has run so far."""
    THETA_PUBLICATIONS = 9
    """Theta processor: a sequence word, odd while it stores one step's rows and step words, even otherwise."""
    OWNER_START = 10
    """The driver's start time, in clock ticks after boot: with OWNER_PID it names one process, pid reuse or not."""
    OWNER_PID_NS = 11
    """Inode of the driver's PID namespace: OWNER_PID means nothing in another namespace. 0 in older versions' files."""
    OWNER_BOOT = 12
    """The first 60 bits of the boot id the driver ran under."""
    DENSE_K = 13
    """Top-k log-probabilities of each model's own distribution recorded per token at most (0: none)."""


STATS_BASE = 16


class Stat(IntEnum):
    """Statistics words (int64) in the header after the fixed words; each has one writer (its prefix's role)."""

    TEACHER_ROWS = STATS_BASE
    THETA_ROWS = STATS_BASE + 1
    TEACHER_WAIT_NS = STATS_BASE + 2
    THETA_WAIT_NS = STATS_BASE + 3
    MIX_NS = STATS_BASE + 4
    TEACHER_STEPS = STATS_BASE + 5
    THETA_STEPS = STATS_BASE + 6
    TEACHER_TIMEOUTS = STATS_BASE + 7
    THETA_TIMEOUTS = STATS_BASE + 8
    TEACHER_ABANDONED = STATS_BASE + 9
    THETA_ABANDONED = STATS_BASE + 10
    SPLIT_STEPS = STATS_BASE + 11
    """Teacher steps whose theta rows arrived in more than one round (batches out of phase; 0 by construction)."""
    LEADER_ADMITTED = STATS_BASE + 12
    LEADER_ENDED = STATS_BASE + 13
    """Requests the teacher scheduler ended itself: aborts, stop strings, errors."""
    FOLLOWER_PLAN_WAIT_NS = STATS_BASE + 14
    """Time the theta scheduler waited for the teacher scheduler's plan."""
    FOLLOWER_DIVERGED = STATS_BASE + 15
    """Plan entries the theta scheduler could not run (each fails its request alone)."""
    PREEMPTIONS_REFUSED = STATS_BASE + 16
    DRAFTED = STATS_BASE + 17
    """Theta's drafts the teacher checked against q (``mode="speculative"``; written by its sampling step): those up
    to and including each round's first rejection (the drafts after it are never looked at)."""
    ACCEPTED = STATS_BASE + 18
    """Of those, the drafts kept; accepted / drafted estimates the per-position acceptance Σ min(π_θ, q)."""
    KERNEL_HANDED_BACK = STATS_BASE + 19
    """Rows a fused decision kernel handed to the torch reference (``Decision.handed_back``): a row outside the
    kernel's domain, or one whose α solve did not converge in its passes."""
    KERNEL_UNCONVERGED = STATS_BASE + 20
    """Of those, the rows whose α solve did not converge in the kernel (``Decision.unconverged``)."""


HEADER_WORDS = 64


class Bell(IntEnum):
    """Doorbells (int32 futex words), one per direction of waiting."""

    THETA_ROWS = 0
    """Theta processor -> teacher processor: rows published."""
    TEACHER_TOKENS = 1
    """Teacher processor -> theta processor: tokens decided."""
    PLAN = 2
    """Teacher scheduler -> theta scheduler: a plan or an ending published. The driver rings it after a submit."""
    TO_LEADER = 3
    """Theta scheduler (arrivals) and driver (submits, aborts) -> teacher scheduler."""


BELL_WORDS = 16  # 64 bytes: their own cache line


class Writer(IntEnum):
    """Who rings a bell; part of the value stored, so two writers never store the same value."""

    DRIVER = 1
    TEACHER_SCHEDULER = 2
    THETA_SCHEDULER = 3
    TEACHER_PROCESSOR = 4
    THETA_PROCESSOR = 5


class Slot(IntEnum):
    """Per-slot control words (int64)."""

    KEY = 0
    """Driver: the occupying request's key (> 0); -key once the driver has read the slot; 0 never used."""
    TEACHER_PROMPT_LEN = 1
    THETA_PROMPT_LEN = 2
    """Driver: prompt lengths, so the teacher scheduler can budget both engines' prefills."""
    ABORT = 3
    """Driver, or either scheduler turning a vLLM abort into a lockstep one: key of the request to end."""
    TEACHER_ARRIVED = 4
    THETA_ARRIVED = 5
    """Each side's scheduler: key of the request once it sits in that scheduler's queue."""
    PHASE = 6
    """Teacher scheduler: :class:`Phase` of the occupying request."""
    ADMIT_PLAN = 7
    """Teacher scheduler: number of the first plan that holds the request."""
    FINISH_PLAN = 8
    """Teacher scheduler: number of the first plan that no longer holds it."""
    FINISH = 9
    """Teacher scheduler: :class:`Finish` reason."""
    STOP_INDEX = 10
    """Teacher scheduler: index of the stop string that ended it, else -1."""
    THETA_STEP = 11
    """Theta processor: step of the row in ``theta_logprobs`` (and ``theta_log_normalisers``), written after them."""
    TEACHER_STEP = 12
    """Teacher processor: step of the token in ``TOKEN`` (written after the token and records)."""
    TOKEN = 13
    NUM_RECORDS = 14
    ERROR = 15
    """The request's error: ``code | step << 8`` in one store (:meth:`SyncSession.fail_slot`); 0 if none."""
    TEACHER_RELEASED = 16
    THETA_RELEASED = 17
    """Key of the request that side no longer touches (its processor saw it leave, or it never ran)."""


CONTROL_WORDS = 24


class Phase(IntEnum):
    """Life of a request in its slot, as the teacher scheduler decides it."""

    EMPTY = 0
    SUBMITTED = 1
    """Opened by the driver; not yet in any plan."""
    RUNNING = 2
    """In every plan from ADMIT_PLAN on."""
    FINISHED = 3
    """In no plan from FINISH_PLAN on (ADMIT_PLAN = -1: never admitted)."""


class Finish(IntEnum):
    """Why a request ended (the teacher scheduler's word on it).

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
    """An exception in an engine's work for this request alone (deciding its token, publishing theta's row,
    checking its stop strings); the engine logs it and serves the other requests."""
    NON_FINITE = 7
    """A decided token's α, log π_t, log π_θ or log q was not finite; nothing of it was recorded."""

    @property
    def label(self) -> str:
        return self.name.lower()


WRITERS: dict[Slot, tuple[str, ...]] = {
    Slot.KEY: ("driver",),
    Slot.TEACHER_PROMPT_LEN: ("driver",),
    Slot.THETA_PROMPT_LEN: ("driver",),
    # The driver's aborts and vLLM's own (which reach one engine's scheduler only) take one route,
    # SyncSession.request_abort, so the leader ends every abort in one place; all store the same key.
    Slot.ABORT: ("driver", "teacher scheduler", "theta scheduler"),
    Slot.TEACHER_ARRIVED: ("teacher scheduler",),
    Slot.THETA_ARRIVED: ("theta scheduler",),
    Slot.PHASE: ("teacher scheduler",),
    Slot.ADMIT_PLAN: ("teacher scheduler",),
    Slot.FINISH_PLAN: ("teacher scheduler",),
    Slot.FINISH: ("teacher scheduler",),
    Slot.STOP_INDEX: ("teacher scheduler",),
    Slot.THETA_STEP: ("theta processor",),
    Slot.TEACHER_STEP: ("teacher processor",),
    Slot.TOKEN: ("teacher processor",),
    # In mode="speculative" the teacher engine's sampling step (processors.speculative) is the teacher processor.
    Slot.NUM_RECORDS: ("teacher processor",),
    # A request fails where its failure is seen: a processor in its row's work (bad logits, a timeout,
    # an exception), a scheduler in its batch (divergence, preemption, a stop-string check, no plan, a
    # shutdown), mostly inside its role's one ending. Every write is SyncSession.fail_slot: one store of
    # code and step, kept only if none is recorded.
    Slot.ERROR: ("teacher processor", "theta processor", "teacher scheduler", "theta scheduler"),
    # On each side, the processor releases a request that reached the model runner, the scheduler one that
    # never did: never both for one key. In mode="speculative" no plugin runs there: the driver releases both
    # once vLLM has ended the request (its final output came).
    Slot.TEACHER_RELEASED: ("teacher processor", "teacher scheduler", "speculative driver"),
    Slot.THETA_RELEASED: ("theta processor", "theta scheduler", "speculative driver"),
}
"""Which role writes each slot word. Words with several writers are written by single stores of values that agree.

Besides these, the driver resets every word of a free slot (:meth:`SyncSession.open_slot`) before it announces
the slot's next request.
"""


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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            need_int(f.name, getattr(self, f.name), 0 if f.name == "dense_k" else 1)

    @staticmethod
    def header_word(name: str) -> Header:
        """The header word that holds field ``name`` (its name in capitals)."""
        return Header[name.upper()]

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each region, each aligned to a cache line, and the total size."""
        sizes = [
            ("header", 8 * HEADER_WORDS),
            ("bells", 4 * BELL_WORDS),
            ("plans", 8 * PLAN_RING * (2 + self.plan_width)),
            ("control", 8 * CONTROL_WORDS * self.slots),
            ("theta_logprobs", 4 * self.vocab * self.slots),
            # float64 per slot: log Σ exp of theta's raw logits row, stored with the row where a repetition
            # penalty needs the mixture's raw logits (written before THETA_STEP announces the row).
            ("theta_log_normalisers", 8 * self.slots),
            ("tokens", 4 * self.max_steps * self.slots),
            ("records", 4 * len(RECORD_FIELDS) * self.max_steps * self.slots),
            ("top_ids", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
            ("top_logq", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
            # log π_t and log π_θ at the same ids (the candidates a beam search extends by).
            ("top_logp_teacher", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
            ("top_logp_theta", 4 * TOP_LOGPROBS_MAX * self.max_steps * self.slots),
            # [slot, step, role (0 teacher, 1 theta), k]
            ("dense_ids", 4 * 2 * self.dense_k * self.max_steps * self.slots),
            ("dense_logp", 4 * 2 * self.dense_k * self.max_steps * self.slots),
            ("dense_other_logp", 4 * 2 * self.dense_k * self.max_steps * self.slots),
        ]
        out, pos = {}, 0
        for name, size in sizes:
            out[name] = pos
            pos += (size + 63) // 64 * 64
        out["total"] = pos
        return out
