"""One sample's request as the driver takes it, its checks, and what each engine is asked to run.

:func:`generation_room` is the one place where the room a prompt pair leaves for generated
tokens is computed: the API clips ``max_tokens`` to it, the server refuses a ``max_tokens``
past it, and the driver refuses a request that does not fit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.roster import Role

__all__ = [
    "DualRequest",
    "Flight",
    "PromptPair",
    "check_request",
    "engine_sampling_params",
    "generation_room",
    "prompt_pairs",
]


def generation_room(max_model_len: int, teacher_ids: Sequence[int], theta_ids: Sequence[int]) -> int:
    """Tokens left for generation after the longer of the two prompts, within ``max_model_len``."""
    return max_model_len - max(len(teacher_ids), len(theta_ids))


@dataclass(frozen=True)
class PromptPair:
    """One prompt tokenized for each engine, and the room it leaves for generated tokens."""

    teacher_ids: list[int]
    theta_ids: list[int]
    room: int
    """Generated tokens at most (:func:`generation_room`); at least 1."""


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
    """The caller's name for the request, unique among those in flight (for an abort); None: one is made up."""


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
    versions: dict[Role, str] = field(default_factory=lambda: {Role.TEACHER: "0", Role.THETA: "0"})
    """The weight version of each engine when the request was launched (it cannot change before it ends)."""


def check_request(request: DualRequest, max_model_len: int, max_dense_logprobs: int) -> None:
    """Refuse, naming the field, a request the session cannot hold."""
    if not request.teacher_prompt_ids or not request.theta_prompt_ids:
        raise ValueError("both prompts must hold at least one token")
    if request.sampling.dense_logprobs > max_dense_logprobs:
        raise ValueError(
            f"dense_logprobs={request.sampling.dense_logprobs} exceeds this engine's "
            f"max_dense_logprobs={max_dense_logprobs}"
        )
    room = generation_room(max_model_len, request.teacher_prompt_ids, request.theta_prompt_ids)
    if request.max_tokens < 1 or request.max_tokens > room:
        raise ValueError(
            f"a prompt of {max_model_len - room} tokens and max_tokens={request.max_tokens} exceed "
            f"max_model_len={max_model_len}"
        )


def engine_sampling_params(flight: Flight) -> tuple[Any, Any]:
    """vLLM's SamplingParams for the teacher engine and for theta's: greedy on logits that allow one token, with the
    pairing (slot, key, decision settings, stop strings) the plugins read from ``extra_args``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    r = flight.request
    pairing = {"slot": flight.slot, "key": flight.key, "sampling": r.sampling.to_dict(), "stop": list(r.stop)}
    # Stop strings are the teacher scheduler's; theta's engine ends where the teacher's does.
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
    tokenizer: Any, vocab: int, max_model_len: int, prompts: Sequence[Any], teacher_prompts: Sequence[Any] | None
) -> list[PromptPair]:
    """Each prompt tokenized for each engine (text with the tokenizer's special tokens, or token ids; theta's
    ``prompts``, the teacher's ``teacher_prompts`` or the same), with its room in ``max_model_len``. ValueError,
    naming the prompt, for an empty one, ids outside [0, vocab), or one that leaves no room."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of prompts, not one string")

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

    theta_ids = [tokenize(p, i, "prompts") for i, p in enumerate(prompts)]
    if teacher_prompts is None:
        teacher_ids = theta_ids
    else:
        if len(teacher_prompts) != len(prompts):
            raise ValueError(f"teacher_prompts has {len(teacher_prompts)} entries but prompts has {len(prompts)}")
        teacher_ids = [tokenize(p, i, "teacher_prompts") for i, p in enumerate(teacher_prompts)]
    pairs = []
    for i, (t, th) in enumerate(zip(teacher_ids, theta_ids)):
        room = generation_room(max_model_len, t, th)
        if room < 1:
            raise ValueError(
                f"prompt {i} has {max_model_len - room} tokens, no room left in max_model_len={max_model_len}"
            )
        pairs.append(PromptPair(t, th, room))
    return pairs
