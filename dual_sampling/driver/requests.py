"""One sample's request as the driver takes it, its checks, and what each engine is asked to run.

:func:`generation_room` is the one place where the room a prompt pair leaves for generated
tokens is computed: the API clips ``max_tokens`` to it, the server refuses a ``max_tokens``
past it, and the driver refuses a request that does not fit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.roster import PAIR, THETA, Role, Roster

__all__ = [
    "DualRequest",
    "Flight",
    "PromptPair",
    "check_request",
    "engine_sampling_params",
    "generation_room",
    "model_prompts",
    "prompt_pairs",
]

TeacherIds = Sequence[int] | Mapping[str, Sequence[int]]
"""The teacher's prompt as token ids; with several teachers, each teacher's by name."""


def teacher_prompt_list(teacher_ids: TeacherIds) -> list[Sequence[int]]:
    """Every teacher's prompt: the one, or each of several."""
    return list(teacher_ids.values()) if isinstance(teacher_ids, Mapping) else [teacher_ids]


def model_prompts(roster: Roster, teacher_ids: TeacherIds, theta_ids: Sequence[int]) -> tuple[Sequence[int], ...]:
    """Each model's prompt in ``roster`` order: θ's, and the teacher's (one teacher) or each teacher's by name
    (several; the names must be the roster's teachers)."""
    if isinstance(teacher_ids, Mapping):
        if set(teacher_ids) != set(roster.teachers):
            raise ValueError(
                f"teacher_prompt_ids: the prompts are named {sorted(teacher_ids)}, the teachers {list(roster.teachers)}"
            )
        by_name = {**teacher_ids, THETA: theta_ids}
    else:
        if len(roster.teachers) != 1:
            raise ValueError(
                f"teacher_prompt_ids: one prompt for the teachers {list(roster.teachers)}; name each teacher's"
            )
        by_name = {roster.teachers[0]: teacher_ids, THETA: theta_ids}
    return tuple(by_name[name] for name in roster.names)


def generation_room(max_model_len: int, teacher_ids: TeacherIds, theta_ids: Sequence[int]) -> int:
    """Tokens left for generation after the longest of the models' prompts, within ``max_model_len``."""
    return max_model_len - max(len(ids) for ids in (*teacher_prompt_list(teacher_ids), theta_ids))


@dataclass(frozen=True)
class PromptPair:
    """One prompt tokenized for each engine, and the room it leaves for generated tokens."""

    teacher_ids: list[int] | dict[str, list[int]]
    """The teacher's prompt; with several teachers, each teacher's by name."""
    theta_ids: list[int]
    room: int
    """Generated tokens at most (:func:`generation_room`); at least 1."""


@dataclass
class DualRequest:
    """One sample to draw: every model's prompt as token ids, and how to draw it."""

    teacher_prompt_ids: list[int] | dict[str, list[int]]
    """The teacher's prompt; with several teachers, each teacher's by name (:func:`model_prompts`)."""
    theta_prompt_ids: list[int]
    sampling: RowSampling
    """The per-token decision's settings, with this sample's seed and the stop token ids (EOS included)."""
    max_tokens: int
    """Generated tokens at most; must fit in max_model_len after the longest prompt."""
    stop: tuple[str, ...] = ()
    """Stop strings (the teacher scheduler looks for them)."""
    request_id: str | None = None
    """The caller's name for the request, unique among those in flight (for an abort); None: one is made up."""
    teachers: tuple[str, ...] | None = None
    """The teachers this sample's mixture takes, in roster order (``generate(..., teachers=...)``); None: every
    teacher of the roster. The others weigh 0 and their engines never see the request."""

    def models(self, roster: Roster) -> tuple[str, ...]:
        """The models whose engines run this request, in roster order: θ and its teachers."""
        chosen = set(roster.teachers if self.teachers is None else self.teachers)
        return tuple(name for name in roster.names if name == THETA or name in chosen)


@dataclass
class Flight:
    """One request between its submission and the moment both engines have let it go."""

    request_id: str
    slot: int
    key: int
    request: DualRequest
    tokens: list[int] = field(default_factory=list)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Deltas (or the exception that ended the request) for the caller's stream."""
    task: asyncio.Task | None = None
    versions: dict[str, str] = field(default_factory=lambda: {Role.TEACHER: "0", Role.THETA: "0"})
    """The weight version of each model when the request was launched, by name."""
    theta_changes: list[tuple[int, str]] = field(default_factory=list)
    """θ updates taken while ``pause(mode="keep")`` held the request, in order: (the count of tokens drawn before,
    the new version). Only θ's weights change under a held request."""


def check_request(request: DualRequest, max_model_len: int, max_dense_logprobs: int, roster: Roster = PAIR) -> None:
    """Refuse, naming the field, a request the session of ``roster``'s models cannot hold."""
    prompts = dict(zip(roster.names, model_prompts(roster, request.teacher_prompt_ids, request.theta_prompt_ids)))
    running = request.models(roster)  # a teacher left out never sees its prompt
    if not all(prompts[name] for name in running):
        raise ValueError("every model's prompt must hold at least one token")
    if request.sampling.dense_logprobs > max_dense_logprobs:
        raise ValueError(
            f"dense_logprobs={request.sampling.dense_logprobs} exceeds this engine's "
            f"max_dense_logprobs={max_dense_logprobs}"
        )
    if request.teachers is not None:
        check_teacher_set(request.teachers, roster)
        if request.sampling.dense_logprobs and len(running) < len(roster.names):  # every model's top k
            raise ValueError("dense_logprobs: a request that leaves teachers out has no log π of theirs to report")
    room = max_model_len - max(len(prompts[name]) for name in running)
    if request.max_tokens < 1 or request.max_tokens > room:
        raise ValueError(
            f"a prompt of {max_model_len - room} tokens and max_tokens={request.max_tokens} exceed "
            f"max_model_len={max_model_len}"
        )


def request_columns(roster: Roster, teachers: Sequence[str] | None) -> tuple[str, ...]:
    """The token columns of the records of a request that mixes ``teachers`` (None: all), in roster order: the
    roster's, but ``logp_<teacher>`` of each teacher it leaves out (never computed; its α column stays: exactly 0)."""
    left_out = {f"logp_{name}" for name in roster.teachers if teachers is not None and name not in teachers}
    return tuple(c for c in roster.token_columns if c not in left_out)


def check_teacher_set(teachers: Any, roster: Roster) -> tuple[str, ...]:
    """``teachers`` as a request's teacher set of ``roster``, in roster order (``generate(..., teachers=...)``);
    ValueError naming the field for anything else: not a list of the roster's teacher names, empty, or with a name
    twice, or a set that leaves out a teacher whose engine leads."""
    names = roster.teachers
    if isinstance(teachers, str) or not isinstance(teachers, (list, tuple)) or not teachers:
        raise ValueError(f"teachers must be a non-empty list of teacher names ({', '.join(names)}), got {teachers!r}")
    unknown = [t for t in teachers if t not in names]
    if unknown:
        raise ValueError(f"teachers: {unknown[0]!r} is not a teacher here ({', '.join(names)})")
    if len(set(teachers)) != len(teachers):
        raise ValueError(f"teachers names a teacher twice: {list(teachers)}")
    if len(teachers) < len(names) and roster.names[0] != THETA:
        raise ValueError(f"teachers: the roster {roster.names} is led by a teacher, whose engine runs every request")
    return tuple(name for name in names if name in teachers)


def engine_sampling_params(flight: Flight) -> tuple[Any, Any]:
    """vLLM's SamplingParams for the leading engine and for a following one: greedy on logits that allow one token,
    with the pairing (slot, key, decision settings, stop strings) the plugins read from ``extra_args``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    r = flight.request
    pairing = {"slot": flight.slot, "key": flight.key, "sampling": r.sampling.to_dict(), "stop": list(r.stop)}
    # Stop strings are the leader's scheduler's; a follower's engine ends where the leader's does.
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


def prompt_pairs(
    tokenizer: Any,
    vocab: int,
    max_model_len: int,
    prompts: Sequence[Any],
    teacher_prompts: Sequence[Any] | Mapping[str, Sequence[Any]] | None,
    roster: Roster | None = None,
) -> list[PromptPair]:
    """Each prompt tokenized for each engine (text with the tokenizer's special tokens, or token ids; theta's
    ``prompts``, the teacher's ``teacher_prompts`` or the same), with its room in ``max_model_len``.
    ``teacher_prompts`` may also map a teacher's name (``roster``'s) to its prompts, as it must with several teachers;
    a teacher it does not name sees theta's. ValueError, naming the prompt, for an empty one, ids outside
    [0, vocab), or one that leaves no room."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of prompts, not one string")
    teachers = (roster or PAIR).teachers

    def tokenize(prompt: str | Sequence[int], index: int, name: str) -> list[int]:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}[{index}] has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError(f"{name}[{index}] is empty")
        return ids

    def tokenize_all(given: Sequence[Any], name: str) -> list[list[int]]:
        if isinstance(given, str):
            raise ValueError(f"{name} must be a list of prompts, not one string")
        if len(given) != len(prompts):
            raise ValueError(f"{name} has {len(given)} entries but prompts has {len(prompts)}")
        return [tokenize(p, i, name) for i, p in enumerate(given)]

    theta_ids = [tokenize(p, i, "prompts") for i, p in enumerate(prompts)]
    teacher_ids: list[Any]
    if not isinstance(teacher_prompts, Mapping) and len(teachers) == 1:
        teacher_ids = theta_ids if teacher_prompts is None else tokenize_all(teacher_prompts, "teacher_prompts")
    else:
        given = {} if teacher_prompts is None else teacher_prompts
        if not isinstance(given, Mapping) or not set(given) <= set(teachers):
            got = f"{type(given).__name__} {list(given)[:5] if isinstance(given, Mapping) else ''}"
            several = "with several teachers, " if len(teachers) > 1 else ""
            raise ValueError(
                f"teacher_prompts: {several}a mapping from teacher names ({', '.join(teachers)}) to their prompts, "
                f"got {got}"
            )
        per_teacher = {
            name: tokenize_all(given[name], f"teacher_prompts[{name!r}]") if name in given else theta_ids
            for name in teachers
        }
        teacher_ids = (
            per_teacher[teachers[0]]
            if len(teachers) == 1
            else [{name: per_teacher[name][i] for name in teachers} for i in range(len(prompts))]
        )
    pairs = []
    for i, (t, th) in enumerate(zip(teacher_ids, theta_ids)):
        room = generation_room(max_model_len, t, th)
        if room < 1:
            raise ValueError(
                f"prompt {i} has {max_model_len - room} tokens, no room left in max_model_len={max_model_len}"
            )
        pairs.append(PromptPair(t, th, room))
    return pairs
