"""Sample → response: the OpenAI bodies of finished samples and the stream chunks of growing ones, the mixture's
per-token records under ``dual_sampling`` and log q as the standard ``logprobs``; nothing sent holds a non-finite
number."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dual_sampling.records import DENSE_FIELDS, SampleDelta, SampleRecord
from dual_sampling.server.translate import Job

__all__ = [
    "chunk",
    "chunk_object",
    "logprobs_block",
    "response_body",
    "response_id",
    "sse",
    "token_records",
    "usage",
]


def response_body(job: Job, samples: list[list[SampleDelta]], piece: Callable[[int], str]) -> bytes:
    """The whole response of a non-streaming request, as JSON bytes: one choice per sample, in this order."""
    choices = [_choice(job, k, ds, piece) for k, ds in enumerate(samples)]
    completion_tokens = sum(len(ds[-1].sample.token_ids) for ds in samples)
    body = {
        "id": response_id(job),
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": choices,
        "usage": usage(len(job.theta_ids) * len(samples), completion_tokens),
    }
    return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()


def _choice(job: Job, index: int, deltas: list[SampleDelta], piece: Callable[[int], str]) -> dict[str, Any]:
    sample = deltas[-1].sample
    records = np.concatenate([d.records for d in deltas]) if deltas else np.zeros((0, len(job.columns)))
    top = [d.top for d in deltas if d.top is not None]
    top_all = (np.concatenate([t[0] for t in top]), np.concatenate([t[1] for t in top])) if top else None
    dense = [d.dense for d in deltas if d.dense is not None]
    dense_all = tuple(np.concatenate(part) for part in zip(*dense)) if dense else None
    extra = token_records(job.columns, sample.teacher_token_ids, records, sample, dense_all)
    logprobs = logprobs_block(job, sample.teacher_token_ids, records, top_all, piece)
    choice: dict[str, Any] = {"index": index}
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": sample.text}
    else:
        choice["text"] = sample.text
    choice.update(
        logprobs=logprobs, finish_reason=sample.finish_reason, stop_reason=sample.stop_reason, dual_sampling=extra
    )
    return choice


def logprobs_block(
    job: Job,
    token_ids: Sequence[int],
    records: np.ndarray,
    top: tuple[np.ndarray, np.ndarray] | None,
    piece: Callable[[int], str],
) -> dict[str, Any] | None:
    """The standard ``logprobs`` of these tokens (log q, and ``job.logprobs`` alternatives each), in the chat or
    the completion shape; None if the request asked for none. ``piece`` decodes one token."""
    if job.logprobs is None:
        return None
    logq = records[:, job.columns.index("logq")].tolist()
    token_ids = token_ids[: len(logq)]  # a failed row's forced token has no record
    strings = [piece(int(t)) for t in token_ids]
    alternatives = []
    for i in range(len(token_ids)):
        if top is None or job.logprobs == 0:
            alternatives.append([])
        else:
            alternatives.append([(piece(int(t)), _logprob(v)) for t, v in zip(top[0][i], top[1][i])])
    if job.kind == "chat":
        return {
            "content": [
                {
                    "token": s,
                    "logprob": lq,
                    "bytes": list(s.encode()),
                    "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alt],
                }
                for s, lq, alt in zip(strings, logq, alternatives)
            ]
        }
    offsets, position = [], 0
    for s in strings:
        offsets.append(position)
        position += len(s)
    return {
        "tokens": strings,
        "token_logprobs": logq,
        "top_logprobs": [dict(alt) for alt in alternatives],
        "text_offset": offsets,
    }


def token_records(
    columns: Sequence[str],
    token_ids: Sequence[int],
    records: np.ndarray,
    sample: SampleRecord | None,
    dense: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The ``dual_sampling`` field of these tokens: ``records`` ``[r, len(columns)]`` under the roster's token
    ``columns``; ``dense`` (ids, own and other log-probabilities ``[r, 2, k]``, a pair's) adds each model's top k
    with both models' log-probabilities at them."""
    out: dict[str, Any] = {"token_ids": list(token_ids)}
    for k, name in enumerate(columns):
        out[name] = records[:, k].tolist()
    if dense is not None:
        for name, (role, part) in DENSE_FIELDS.items():
            out[name] = dense[part][:, role].tolist()
    if sample is not None:
        out["log_w_theta"] = sample.log_w_theta if sample.error is None else None
        out["error"] = sample.error
        out["teacher_version"], out["theta_version"] = sample.teacher_version, sample.theta_version
        if sample.theta_versions is not None:
            out["theta_versions"] = list(sample.theta_versions)
    return out


def _logprob(value: float) -> float:
    """An alternative's log q: -inf (filtered out by top-k, top-p or min-p) is sent as -9999.0, as vLLM does."""
    return float(value) if math.isfinite(value) else -9999.0


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_id(job: Job) -> str:
    return f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def chunk(
    job: Job,
    request_id: str,
    created: int,
    index: int,
    delta: Any,
    *,
    logprobs: Any = None,
    extra: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    if job.kind == "chat":
        choice = {
            "index": index,
            "delta": delta if isinstance(delta, dict) else {"content": delta},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    if extra is not None:
        choice["dual_sampling"] = extra
    return {"id": request_id, "object": chunk_object(job), "created": created, "model": job.model, "choices": [choice]}


def sse(payload: dict[str, Any]) -> str:
    # allow_nan=False: a non-finite value would be bare NaN, which is not JSON; it is a bug upstream, and raises.
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"
