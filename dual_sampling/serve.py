"""An OpenAI-compatible server for the mixture: ``dual-sampling serve``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or false),
``GET /v1/models``, ``GET /health`` (200 only while both engines run) and ``GET /metrics``
(Prometheus text). Requests are parsed with vLLM's own OpenAI request models; responses
are vLLM's OpenAI response models. Every choice also carries, under the key
``dual_sampling``, the per-token records of its tokens (α, log π_t, log π_θ, log q, the
token ids) and, on its last chunk, ``log_w_theta`` and any error. The standard
``logprobs`` report log q, the distribution actually sampled.

The teacher's view comes from extra body fields: ``teacher_prompt`` (completions) or
``teacher_messages`` (chat) replace the teacher's input; ``hint`` is rendered into the
teacher's user message with the template of ``dual-sampling generate``.

Under load: at most ``max_queue`` samples are held at once (a request of ``n`` holds ``n``);
past it a request gets 429 at once. Samples are served first come first served. A client
that disconnects has its request aborted on both engines at the next step. A dead engine
turns ``/health`` red, ends the requests in flight with an error and makes new ones 503.
Bad input is a 400 naming the field; nothing the client sends causes a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dual_sampling.config import SamplingOptions
from dual_sampling.outputs import SampleRecord
from dual_sampling.protocol import RECORD_FIELDS, SyncError
from dual_sampling.scheduler import SampleDelta
from dual_sampling.text import TextStream

__all__ = ["ServeOptions", "build_app", "serve"]

API_KEY_ENV = "DUAL_SAMPLING_API_KEY"


@dataclass(kw_only=True)
class ServeOptions:
    """How the server listens and what it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; only this machine can connect unless it is changed."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """Require ``Authorization: Bearer <key>`` on /v1 routes (default: the DUAL_SAMPLING_API_KEY variable, if set)."""
    served_model_name: str = "dual"
    """The model name /v1/models lists and responses carry (requests may name it or leave it out)."""
    max_queue: int = 256
    """Samples held at once, running or waiting for the engines; a request past it gets 429."""
    max_n: int = 16
    """Largest n (and best_of) a request may ask for."""
    max_body_bytes: int = 1 << 20
    """Largest request body; a larger one gets 413."""

    def __post_init__(self) -> None:
        for name in ("port", "max_queue", "max_n", "max_body_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None


class BadRequest(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Request fields the server acts on. Any other field of vLLM's request models must keep its default.
_COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logit_bias",
    "user",
    "request_id",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "best_of"}
_EXTRA_FIELDS = {"teacher_prompt", "teacher_messages", "hint"}
_PENALTY_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass
class _Job:
    """A parsed request: one prompt pair, its sampling options, and how to answer."""

    kind: str
    """"chat" or "completion"."""
    theta_ids: list[int]
    teacher_ids: list[int]
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    logprobs: int | None
    """None: no logprobs; k >= 0: the sampled token's log q and k alternatives."""
    model: str


class DualService:
    """The server's state: the dual engine, admission, metrics."""

    def __init__(self, dual: Any, options: ServeOptions) -> None:
        self.dual, self.options = dual, options
        self.held = 0
        """Samples accepted and not yet finished."""
        self.metrics = _Metrics(self)
        self._hint_template = None

    # ------------------------------------------------------------------ parsing

    def parse(self, body: dict[str, Any], kind: str) -> _Job:
        from pydantic import ValidationError

        model_cls = _request_model(kind)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
            raise BadRequest(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param) from None
        except Exception as exc:  # vLLM's own request checks raise their own errors; still the client's input
            raise BadRequest(str(exc), getattr(exc, "parameter", None)) from None
        fields = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
        for name in sorted(body):
            if name in fields or name in _EXTRA_FIELDS:
                continue
            default = (
                model_cls.model_fields[name].get_default(call_default_factory=True)
                if name in model_cls.model_fields
                else None
            )
            if name not in model_cls.model_fields or getattr(req, name, None) != default:
                raise BadRequest(f"{name} is not supported by dual-sampling", name)
        for name, neutral in _PENALTY_NEUTRAL.items():
            value = getattr(req, name, None)
            if value is not None and value != neutral:
                raise BadRequest(f"{name} is not supported: penalties would act after the token is forced", name)
        if req.model not in (None, self.options.served_model_name):
            raise BadRequest(
                f"model {req.model!r} is not served here; use {self.options.served_model_name!r}",
                "model",
                404,
                "not_found_error",
            )
        extra = {k: body[k] for k in _EXTRA_FIELDS if k in body}
        theta_text, teacher_text = self._prompts(req, kind, extra)
        try:
            (teacher_ids,), (theta_ids,) = self.dual._prompt_pairs([theta_text], [teacher_text])
        except ValueError as exc:
            raise BadRequest(
                str(exc).replace("prompt 0", "the prompt"), "messages" if kind == "chat" else "prompt"
            ) from None
        room = self.dual.max_model_len - max(len(teacher_ids), len(theta_ids))
        # The raw body's value (already type-checked): vLLM's chat model warns on reading max_tokens.
        max_tokens = (body.get("max_completion_tokens") or body.get("max_tokens")) if kind == "chat" else req.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(
                f"max_tokens={max_tokens} does not fit: the prompt leaves {room} of max_model_len="
                f"{self.dual.max_model_len} tokens",
                "max_tokens",
            )
        logprobs = self._logprobs(req, kind)
        n = req.n or 1
        best_of = getattr(req, "best_of", None) if kind == "completion" else None
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.options.max_n:
                raise BadRequest(f"{name}={value} exceeds this server's limit of {self.options.max_n}", name)
        if req.stream and best_of is not None and best_of != n:
            raise BadRequest("best_of cannot be combined with stream", "best_of")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            sampling = SamplingOptions(
                max_tokens=max_tokens or room,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k,
                min_p=req.min_p or 0.0,
                min_tokens=req.min_tokens or 0,
                stop=stop,
                stop_token_ids=list(req.stop_token_ids or []),
                n=n,
                best_of=best_of,
                logit_bias=_token_bias(req.logit_bias),
                seed=secrets.randbits(62) if req.seed is None else req.seed,
                top_logprobs=logprobs or 0,
            )
            sampling.check_vocab(self.dual.vocab)
        except ValueError as exc:
            raise BadRequest(str(exc), str(exc).split(" ")[0]) from None
        stream_options = getattr(req, "stream_options", None)
        return _Job(
            kind,
            theta_ids,
            teacher_ids,
            sampling,
            bool(req.stream),
            bool(stream_options and stream_options.include_usage),
            logprobs,
            self.options.served_model_name,
        )

    def _prompts(self, req: Any, kind: str, extra: dict[str, Any]) -> tuple[Any, Any]:
        """(theta's prompt, teacher's prompt): text rendered with the chat template, or token ids."""
        hint = extra.get("hint")
        if hint is not None and not isinstance(hint, str):
            raise BadRequest("hint must be a string", "hint")
        if kind == "chat":
            messages = _messages(req.messages, "messages")
            teacher = _messages(extra["teacher_messages"], "teacher_messages") if "teacher_messages" in extra else None
            if teacher is not None and hint is not None:
                raise BadRequest("give either teacher_messages or hint, not both", "hint")
            if teacher is None:
                teacher = [dict(m) for m in messages]
                if hint is not None:
                    last = max(i for i, m in enumerate(teacher) if m["role"] == "user")
                    teacher[last]["content"] = self._with_hint(teacher[last]["content"], hint)
            return self._chat(messages, "messages"), self._chat(teacher, "teacher_messages")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequest("send one prompt per request", "prompt")
            prompt = prompt[0]
        if prompt in ("", []):
            raise BadRequest("prompt is empty", "prompt")
        teacher = extra.get("teacher_prompt")
        if teacher is not None and hint is not None:
            raise BadRequest("give either teacher_prompt or hint, not both", "hint")
        if teacher is None:
            teacher = self._with_hint(prompt, hint) if hint is not None else prompt
        elif not (isinstance(teacher, str) or (isinstance(teacher, list) and all(isinstance(t, int) for t in teacher))):
            raise BadRequest("teacher_prompt must be a string or a list of token ids", "teacher_prompt")
        return prompt, teacher

    def _with_hint(self, problem: Any, hint: str) -> str:
        if not isinstance(problem, str):
            raise BadRequest("hint needs a text prompt, not token ids", "hint")
        if self._hint_template is None:
            from dual_sampling.datagen import DEFAULT_TEACHER_TEMPLATE, user_template

            self._hint_template = user_template(None, DEFAULT_TEACHER_TEMPLATE)
        return self._hint_template.render(problem=problem, hint=hint, row={})

    def _chat(self, messages: list[dict[str, str]], param: str) -> str:
        try:
            return self.dual.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template that refuses the conversation (roles out of order, ...)
            raise BadRequest(f"{param}: the chat template refused these messages ({exc})", param) from None

    @staticmethod
    def _logprobs(req: Any, kind: str) -> int | None:
        if kind == "chat":
            if not req.logprobs:
                if req.top_logprobs:
                    raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
                return None
            return int(req.top_logprobs or 0)
        return None if req.logprobs is None else int(req.logprobs)

    # ------------------------------------------------------------------ running

    def admit(self, job: _Job) -> _Reservation:
        """Hold room for the job's samples, or refuse at once (503 with dead engines, 429 past the bound)."""
        failure = self.dual.scheduler.failure
        if failure is not None:
            raise BadRequest(f"the engines are not running: {failure}", None, 503, "service_unavailable")
        draws = job.sampling.draws
        if self.held + draws > self.options.max_queue:
            self.metrics.rejected += 1
            message = (
                f"the server holds {self.held} samples, the most it takes is {self.options.max_queue}; retry later"
            )
            raise BadRequest(message, None, 429, "rate_limit_error")
        self.held += draws
        return _Reservation(self, draws)

    async def samples(self, job: _Job) -> AsyncIterator[tuple[int, SampleDelta]]:
        """(sample index, delta) from every sample of ``job``, as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def one(index: int) -> None:
            try:
                async for delta in self.dual.stream(
                    self.job_prompt(job, "theta"),
                    self.job_prompt(job, "teacher"),
                    sampling=job.sampling,
                    sample_key=0,
                    sample_index=index,
                ):
                    queue.put_nowait((index, delta))
            except BaseException as exc:
                queue.put_nowait((index, exc))
                raise
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(one(i)) for i in range(job.sampling.draws)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        continue
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def job_prompt(job: _Job, side: str) -> list[int]:
        return job.theta_ids if side == "theta" else job.teacher_ids

    # ------------------------------------------------------------------ answers

    async def complete(self, job: _Job) -> dict[str, Any]:
        """The whole response of a non-streaming request."""
        deltas: dict[int, list[SampleDelta]] = {}
        async for index, delta in self.samples(job):
            deltas.setdefault(index, []).append(delta)
        samples = [(i, ds) for i, ds in sorted(deltas.items())]
        if job.sampling.best_of:
            samples.sort(key=lambda item: -_score(item[1][-1].sample, job.sampling.best_of_score))
            samples = samples[: job.sampling.n]
        choices = [self._choice(job, k, ds) for k, (_, ds) in enumerate(samples)]
        completion_tokens = sum(len(ds[-1].sample.token_ids) for _, ds in samples)
        usage = _usage(len(job.theta_ids) * len(samples), completion_tokens)
        for _, ds in samples:
            self.metrics.observe(ds[-1].sample)
        return _response(job, choices, usage)

    def _choice(self, job: _Job, index: int, deltas: list[SampleDelta]) -> dict[str, Any]:
        sample = deltas[-1].sample
        records = np.concatenate([d.records for d in deltas]) if deltas else np.zeros((0, len(RECORD_FIELDS)))
        top = [d.top for d in deltas if d.top is not None]
        top_all = (np.concatenate([t[0] for t in top]), np.concatenate([t[1] for t in top])) if top else None
        extra = _records(sample.teacher_token_ids, records, sample)
        logprobs = self._logprobs_block(job, sample.teacher_token_ids, records, top_all, sample.text)
        if job.kind == "chat":
            return {
                "index": index,
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": logprobs,
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
                "dual_sampling": extra,
            }
        return {
            "index": index,
            "text": sample.text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            "dual_sampling": extra,
        }

    def _logprobs_block(
        self,
        job: _Job,
        token_ids: Sequence[int],
        records: np.ndarray,
        top: tuple[np.ndarray, np.ndarray] | None,
        text: str,
    ) -> dict[str, Any] | None:
        if job.logprobs is None:
            return None
        tok = self.dual.tokenizer
        logq = records[:, RECORD_FIELDS.index("logq")].tolist()
        strings = [tok.decode([t]) for t in token_ids]
        alternatives = []
        for i in range(len(token_ids)):
            if top is None or job.logprobs == 0:
                alternatives.append([])
            else:
                alternatives.append([(tok.decode([int(t)]), float(v)) for t, v in zip(top[0][i], top[1][i])])
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

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        """Server-sent events: OpenAI chunks, then ``data: [DONE]``."""
        request_id = _response_id(job)
        created = int(time.time())
        tok = self.dual.tokenizer
        texts = {i: TextStream(tok, job.sampling.stop, job.sampling.stop_token_ids) for i in range(job.sampling.n)}
        completion_tokens = 0
        if job.kind == "chat":
            for i in range(job.sampling.n):
                yield _sse(_chunk(job, request_id, created, i, {"role": "assistant", "content": ""}))
        try:
            async for index, delta in self.samples(job):
                extra = _records(delta.token_ids, delta.records, delta.sample)
                logprobs = self._logprobs_block(job, delta.token_ids, delta.records, delta.top, "")
                if delta.sample is None:
                    piece = texts[index].push(delta.token_ids)
                    yield _sse(_chunk(job, request_id, created, index, piece, logprobs=logprobs, extra=extra))
                    continue
                sample = delta.sample
                completion_tokens += len(sample.token_ids)
                self.metrics.observe(sample)
                piece = texts[index].finish(sample.text)
                yield _sse(
                    _chunk(
                        job,
                        request_id,
                        created,
                        index,
                        piece,
                        logprobs=logprobs,
                        extra=extra,
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                    )
                )
        except (SyncError, BadRequest) as exc:
            message = exc.message if isinstance(exc, BadRequest) else str(exc)
            yield _sse(error_body(message, 503, "service_unavailable"))
        if job.include_usage:
            usage = _usage(len(job.theta_ids) * job.sampling.n, completion_tokens)
            yield _sse(
                {
                    "id": request_id,
                    "object": _chunk_object(job),
                    "created": created,
                    "model": job.model,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield "data: [DONE]\n\n"

    def healthy(self) -> bool:
        scheduler = self.dual.scheduler
        return scheduler.failure is None and scheduler.engines is not None and scheduler.engines.dead() is None


class _Reservation:
    """Room held for one request's samples; released once, however the request ends."""

    def __init__(self, service: DualService, draws: int) -> None:
        self.service, self.draws = service, draws

    def release(self) -> None:
        if self.draws:
            self.service.held -= self.draws
            self.draws = 0


# ---------------------------------------------------------------------- helpers


def _request_model(kind: str):
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def _messages(messages: Any, param: str) -> list[dict[str, str]]:
    """Plain {role, content} messages; content parts are joined. Refuses what a text model cannot take."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"{param} must be a non-empty list of messages", param)
    out = []
    for i, message in enumerate(messages):
        m = dict(message) if isinstance(message, dict) else getattr(message, "__dict__", None)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{param}[{i}] must be an object with a role", f"{param}[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f"{param}[{i}].content: only text parts are supported", f"{param}[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str) or not content:
            raise BadRequest(f"{param}[{i}] has no content", f"{param}[{i}].content")
        out.append({"role": m["role"], "content": content})
    if not any(m["role"] == "user" for m in out):
        raise BadRequest(f"{param} holds no user message", param)
    return out


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def _records(token_ids: Sequence[int], records: np.ndarray, sample: SampleRecord | None) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": list(token_ids)}
    for k, name in enumerate(RECORD_FIELDS):
        out[name] = records[:, k].tolist()
    if sample is not None:
        out["log_w_theta"] = sample.log_w_theta if sample.error is None else None
        out["error"] = sample.error
    return out


def _score(sample: SampleRecord, name: str) -> float:
    values = getattr(sample, name)
    return math.fsum(values) if sample.error is None else -math.inf


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _response_id(job: _Job) -> str:
    return f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _chunk_object(job: _Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _response(job: _Job, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    cls = ChatCompletionResponse if job.kind == "chat" else CompletionResponse
    return cls.model_validate(
        {"id": _response_id(job), "model": job.model, "choices": choices, "usage": usage}
    ).model_dump(mode="json", exclude_none=False)


def _chunk(
    job: _Job,
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
    return {"id": request_id, "object": _chunk_object(job), "created": created, "model": job.model, "choices": [choice]}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Metrics:
    """Prometheus metrics: requests, tokens, running and queued samples, α, sync waits and timeouts, engine deaths."""

    def __init__(self, service: DualService) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dual_sampling_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.finished = Counter(
            "dual_sampling_samples_finished", "Samples by finish reason", ["finish_reason"], registry=self.registry
        )
        self.tokens = Counter("dual_sampling_generated_tokens", "Tokens of finished samples", registry=self.registry)
        self.disconnects = Counter(
            "dual_sampling_client_disconnects", "Requests whose client went away", registry=self.registry
        )
        self.alpha = Histogram(
            "dual_sampling_alpha",
            "Teacher weight α per generated token",
            buckets=[i / 10 for i in range(1, 11)],
            registry=self.registry,
        )
        self.rejected = 0
        self.registry.register(_EngineCollector(service))

    def observe(self, sample: SampleRecord) -> None:
        self.finished.labels(sample.finish_reason or "unknown").inc()
        self.tokens.inc(len(sample.token_ids))
        for a in sample.alpha:
            self.alpha.observe(a)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engines at scrape time."""

    def __init__(self, service: DualService) -> None:
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        scheduler = self.service.dual.scheduler
        stats = scheduler.statistics()
        yield GaugeMetricFamily(
            "dual_sampling_requests_running", "Samples in the engines", value=len(scheduler.in_flight())
        )
        yield GaugeMetricFamily(
            "dual_sampling_requests_queued", "Samples waiting for the engines", value=stats["queued"]
        )
        yield GaugeMetricFamily(
            "dual_sampling_samples_held", "Samples the server holds (running or queued)", value=self.service.held
        )
        waits = CounterMetricFamily(
            "dual_sampling_sync_wait_seconds", "Time an engine waited for its partner", labels=["side"]
        )
        for side, key in (
            ("teacher", "teacher_wait_s"),
            ("theta", "theta_wait_s"),
            ("theta_plan", "follower_plan_wait_s"),
        ):
            waits.add_metric([side], stats.get(key, 0.0))
        yield waits
        yield CounterMetricFamily(
            "dual_sampling_sync_timeouts",
            "Rows failed after sync_timeout",
            value=stats.get("teacher_timeouts", 0) + stats.get("theta_timeouts", 0),
        )
        yield CounterMetricFamily(
            "dual_sampling_engine_deaths",
            "Engine processes that exited",
            value=int(scheduler.failure is not None and "engine failed" in str(scheduler.failure)),
        )
        yield CounterMetricFamily(
            "dual_sampling_rejected_requests", "Requests refused with 429", value=self.service.metrics.rejected
        )


# ---------------------------------------------------------------------- the app


def build_app(dual: Any, options: ServeOptions | None = None):
    """The FastAPI app serving ``dual`` (an open :class:`OptimalSamplingDual`)."""
    options = options or ServeOptions()
    service = DualService(dual, options)
    app = FastAPI(title="dual-sampling", docs_url=None, redoc_url=None)
    app.state.service = service

    def error(exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, exc.kind, exc.param), status_code=exc.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        authorized = request.headers.get("authorization") == f"Bearer {options.api_key}"
        if request.url.path.startswith("/v1") and options.api_key and not authorized:
            message = "a valid API key is required (Authorization: Bearer <key>)"
            return error(BadRequest(message, None, 401, "authentication_error"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > options.max_body_bytes:
            return error(BadRequest(f"the request body exceeds {options.max_body_bytes} bytes", None, 413))
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > options.max_body_bytes:
                raise BadRequest(f"the request body exceeds {options.max_body_bytes} bytes", None, 413)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRequest(
                f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    class EventStream(StreamingResponse):
        """Server-sent events whose reservation is released however the response ends (even before it starts)."""

        def __init__(self, events: _Events, reservation: _Reservation) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.events, self.reservation = events, reservation

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                with contextlib.suppress(BaseException):
                    await self.events.aclose()  # aborts its samples on both engines if they still run
                if not self.events.completed:
                    service.metrics.disconnects.inc()
                self.reservation.release()

    async def handle(request: Request, kind: str, route: str):
        try:
            job = service.parse(await body_of(request), kind)
            reservation = service.admit(job)
        except BadRequest as exc:
            service.metrics.requests.labels(route, str(exc.status)).inc()
            return error(exc)
        if job.stream:
            service.metrics.requests.labels(route, "200").inc()
            return EventStream(_Events(service.stream(job)), reservation)
        task = asyncio.ensure_future(service.complete(job))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client went away: abort its samples on both engines
                task.cancel()
                service.metrics.disconnects.inc()
                with contextlib.suppress(BaseException):
                    await task
                return Response(status_code=499)
            try:
                body = task.result()
            except SyncError as exc:
                service.metrics.requests.labels(route, "503").inc()
                return error(BadRequest(str(exc), None, 503, "service_unavailable"))
            service.metrics.requests.labels(route, "200").inc()
            return JSONResponse(body)
        finally:
            watcher.cancel()
            reservation.release()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion", "completions")

    @app.get("/v1/models")
    async def models():
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(
            id=options.served_model_name,
            owned_by="dual-sampling",
            max_model_len=dual.max_model_len,
            root=dual.config.model_teacher,
        )
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/health")
    async def health():
        if service.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            {"status": "unavailable", "reason": str(dual.scheduler.failure or "an engine is dead")}, status_code=503
        )

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def _disconnected(request: Any) -> None:
    """Return once the client has closed its connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Events:
    """An async iterator over events that remembers whether it ran to its end."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events, self.completed = events, False

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> str:
        try:
            return await self.events.__anext__()
        except StopAsyncIteration:
            self.completed = True
            raise

    async def aclose(self) -> None:
        await self.events.aclose()


def serve(dual: Any, options: ServeOptions) -> None:
    """Serve ``dual`` until interrupted (blocking)."""
    import uvicorn

    uvicorn.run(
        build_app(dual, options), host=options.host, port=options.port, log_level="info", timeout_graceful_shutdown=5
    )
