"""The server's request and response bodies: vLLM's OpenAI models, extended with the mixture's fields.

Requests take the teacher's view of the prompt (``teacher_prompt``, ``teacher_messages``, ``hint``; with several
teachers, one for all or one per teacher name); every choice carries the per-token records of its tokens under
``dual_sampling``, in the columns of the server's roster (:func:`response_model`). The models are the server's
contract: they validate requests, build responses, and make up ``/openapi.json``. Everything else of a request is
vLLM's own field, checked by vLLM's own validators.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, OpenAIBaseModel
from vllm.renderers.chat_utils import ChatCompletionMessageParam

from dual_sampling.records import DENSE_FIELDS, DENSE_ROLES
from dual_sampling.roster import PAIR, Roster

__all__ = [
    "DualChatCompletionRequest",
    "DualChatCompletionResponse",
    "DualChatCompletionStreamResponse",
    "DualCompletionRequest",
    "DualCompletionResponse",
    "DualCompletionStreamResponse",
    "DualRecords",
    "ErrorInfo",
    "ErrorResponse",
    "FinishWeightUpdateRequest",
    "InitWeightTransferRequest",
    "StartWeightUpdateRequest",
    "UpdateWeightVersionRequest",
    "UpdateWeightsRequest",
    "WeightChunkRequest",
    "WeightsFromPath",
    "records_model",
    "response_model",
]

_HINT_DOC = (
    "A reference solution or other privileged text, rendered into the teacher's prompt only (with the template "
    "of `dual-sampling generate`). With several teachers, one hint every teacher sees, or {teacher name: hint}: a "
    "teacher not named sees theta's prompt."
)
_PER_TEACHER = "With several teachers, one for every teacher or {teacher name: ...}; a teacher not named sees theta's."
_TokenIds = list[Annotated[int, Field(ge=0)]]


def _dense_logprobs_field() -> Any:
    return Field(
        default=None,
        ge=0,
        description="Per token, also return the teacher's k most likely tokens with log π_t and theta's k most likely "
        "with log π_θ (the models' own distributions, untempered and unfiltered), under `dual_sampling`; at most the "
        "server's --max-dense-logprobs.",
    )


def _teachers_field() -> Any:
    return Field(
        default=None,
        description="With several teachers: the teachers this request mixes, by name (default: all). The others weigh "
        "0 and their engines do no work for it; its records carry their alpha (0) and no log π (null).",
    )


class DualCompletionRequest(CompletionRequest):
    """vLLM's completion request, plus the teacher's own prompt or a hint for it."""

    teacher_prompt: str | _TokenIds | dict[str, str | _TokenIds] | None = Field(
        default=None,
        description="The teacher's prompt (text or token ids); default: the same prompt as theta's. " + _PER_TEACHER,
    )
    hint: str | dict[str, str] | None = Field(default=None, description=_HINT_DOC)
    teachers: list[str] | None = _teachers_field()
    dense_logprobs: int | None = _dense_logprobs_field()
    best_of: int | None = Field(
        default=None,
        ge=1,
        description="Draw this many samples (>= n) and return the n with the highest summed log q "
        "(vLLM 0.32 no longer has this field; the mixture keeps OpenAI's meaning).",
    )

    @model_validator(mode="after")
    def _one_teacher_view(self) -> DualCompletionRequest:
        if self.teacher_prompt is not None and self.hint is not None:
            raise ValueError("give either teacher_prompt or hint, not both")
        return self


class DualChatCompletionRequest(ChatCompletionRequest):
    """vLLM's chat request, plus the teacher's own conversation or a hint for it."""

    teacher_messages: list[ChatCompletionMessageParam] | dict[str, list[ChatCompletionMessageParam]] | None = Field(
        default=None, description="The teacher's conversation; default: the same messages as theta's. " + _PER_TEACHER
    )
    hint: str | dict[str, str] | None = Field(default=None, description=_HINT_DOC)
    teachers: list[str] | None = _teachers_field()
    dense_logprobs: int | None = _dense_logprobs_field()

    @model_validator(mode="after")
    def _one_teacher_view(self) -> DualChatCompletionRequest:
        if self.teacher_messages is not None and self.hint is not None:
            raise ValueError("give either teacher_messages or hint, not both")
        return self


@functools.cache
def _column_field(name: str, roster: Roster) -> tuple[Any, Any]:
    """A per-token record column's field: a teacher's log π with several teachers is null for a request that left
    the teacher out (``teachers``); every other column is always there."""
    if roster != PAIR and name in {f"logp_{t}" for t in roster.teachers}:
        return list[float] | None, Field(
            default=None, description=f"Per-token {name}; null if the request left it out."
        )
    return list[float], Field(description=f"Per-token {name}.")


def records_model(roster: Roster = PAIR) -> type[OpenAIBaseModel]:
    """The ``dual_sampling`` field of a choice: the records of its tokens in ``roster``'s token columns (a pair's
    ``alpha``, ``logp_teacher``, ``logp_theta``, ``logq``; with several teachers ``alpha_<teacher>`` per teacher and
    ``logp_<model>`` per model); the dense top-k fields for a pair only."""
    dense = {
        name: (
            list[list[int if part == 0 else float]] | None,
            Field(
                default=None,
                description=f"With dense_logprobs k: per token, {DENSE_ROLES[role]}'s k most likely tokens, most "
                "likely first: "
                + (
                    "their ids.",
                    f"log π of {DENSE_ROLES[role]} at them.",
                    f"log π of {DENSE_ROLES[1 - role]} at them.",
                )[part],
            ),
        )
        for name, (role, part) in DENSE_FIELDS.items()
    }
    return create_model(
        "DualRecords" if roster == PAIR else "DualRecords_" + "_".join(roster.names),
        __base__=OpenAIBaseModel,
        __doc__="The mixture's records of a choice's tokens (of this chunk's tokens, when streaming). α is a "
        "teacher's weight; log-probabilities are natural logs; every list has one entry per token.",
        token_ids=(list[int], Field(description="The generated token ids.")),
        **{name: _column_field(name, roster) for name in roster.token_columns},
        log_w_theta=(
            float | None,
            Field(default=None, description="On a sample's last chunk: Σ(log π_θ − log q), the sequence log-weight."),
        ),
        error=(str | None, Field(default=None, description="On a sample's last chunk: why it failed, if it did.")),
        **(dense if roster == PAIR else {}),
        teacher_version=(
            str | None,
            Field(
                default=None,
                description="On a sample's last chunk: the teacher's weight version that drew it (with several "
                "teachers, the first teacher's).",
            ),
        ),
        theta_version=(
            str | None,
            Field(
                default=None,
                description="On a sample's last chunk: theta's weight version that drew it (the policy the "
                "importance weights refer to); that of its first token where its tokens span a theta update taken "
                "while /pause?mode=keep held it.",
            ),
        ),
        theta_versions=(
            list[str] | None,
            Field(
                default=None,
                description="On a sample's last chunk, only where its tokens span a theta update taken while "
                "/pause?mode=keep held it: theta's weight version that drew each token.",
            ),
        ),
    )


DualRecords = records_model(PAIR)


@functools.cache
def response_model(kind: str, roster: Roster = PAIR, stream: bool = False) -> type:
    """The response body of a ``kind`` ("chat" or "completion") request to a server of ``roster``'s models (a stream's
    chunk with ``stream``): vLLM's model, each choice with the ``dual_sampling`` records."""
    response, choice = {
        ("chat", False): (ChatCompletionResponse, ChatCompletionResponseChoice),
        ("chat", True): (ChatCompletionStreamResponse, ChatCompletionResponseStreamChoice),
        ("completion", False): (CompletionResponse, CompletionResponseChoice),
        ("completion", True): (CompletionStreamResponse, CompletionResponseStreamChoice),
    }[kind, stream]
    suffix = "" if roster == PAIR else "_" + "_".join(roster.names)
    with_records = create_model(
        "Dual" + choice.__name__.replace("Response", "") + suffix,  # DualChatCompletionStreamChoice, as before
        __base__=choice,
        __doc__=f"vLLM's {choice.__name__} with the mixture's records.",
        dual_sampling=(
            records_model(roster) | None,
            Field(default=None, description="The mixture's per-token records."),
        ),
    )
    return create_model(
        "Dual" + response.__name__ + suffix,
        __base__=response,
        __doc__=f"vLLM's {response.__name__} with the mixture's records in each choice.",
        choices=(list[with_records], ...),
    )


DualCompletionResponse = response_model("completion")
DualCompletionStreamResponse = response_model("completion", stream=True)
DualChatCompletionResponse = response_model("chat")
DualChatCompletionStreamResponse = response_model("chat", stream=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_VERSION = Field(min_length=1, max_length=256)


class WeightsFromPath(_Strict):
    """Where the new weights are: a folder of safetensors files under one of the server's ``weights_dirs``."""

    weights_path: str = Field(min_length=1, max_length=4096, description="Folder of the new safetensors files.")


class UpdateWeightsRequest(_Strict):
    """``POST /update_weights`` naming a folder: new weights for the theta engine in one call (this server's own use
    of vLLM's route; a weight-transfer engine's chunk is a :class:`WeightChunkRequest`)."""

    update_info: WeightsFromPath
    weight_version: Annotated[str, _VERSION] | None = Field(
        default=None,
        description="The new weights' version label: one theta's weights never carried, the current label included "
        "(a used label is refused, 400); default: the count of updates, or the next count no weights carried.",
    )
    mode: Literal["wait", "abort"] = Field(
        default="wait", description="Requests in flight finish on the old weights (wait) or are aborted (abort)."
    )


class InitWeightTransferRequest(_Strict):
    """``POST /init_weight_transfer_engine`` (vLLM's route and body). The server's engine is the shared-memory one
    (``processors.weight_transfer``), which needs no rendezvous: ``init_info`` must be empty."""

    init_info: dict[str, Any] = Field(default_factory=dict, description="Must be {} for the shared-memory engine.")


class StartWeightUpdateRequest(_Strict):
    """``POST /start_weight_update`` and ``/start_draft_weight_update``: begin an update of theta's weights (vLLM's
    routes; TRL's client sends ``is_checkpoint_format``). Chunks follow, then ``/finish_weight_update``."""

    is_checkpoint_format: Literal[True] = Field(
        default=True, description="The chunks hold tensors as the checkpoint names them (the only format taken)."
    )


class WeightChunkRequest(_Strict):
    """``POST /update_weights`` with a weight-transfer engine's payload (vLLM's body): one chunk of the open update,
    checked as it comes. Told apart from a folder update by its ``update_info``, which names no ``weights_path``."""

    update_info: Any = Field(
        description="An object, a chunk of the shared-memory engine (path, names, dtype_names, shapes, offsets: "
        "processors.weight_transfer.SharedMemoryUpdateInfo), or a list of one per worker (one here); its form is "
        "checked with the chunk, each error naming update_info."
    )


class FinishWeightUpdateRequest(_Strict):
    """``POST /finish_weight_update`` (vLLM's route and body): load the open update's chunks into theta's engine."""

    weight_version: Annotated[str, _VERSION] | None = Field(
        default=None,
        description="The new weights' version label: one theta's weights never carried (a used label is refused, "
        "400); default: the count of updates, or the next count no weights carried.",
    )


class UpdateWeightVersionRequest(_Strict):
    """``POST /update_weight_version``: a new label for theta's current weights (vLLM's route and body)."""

    new_version: Annotated[str, _VERSION]
