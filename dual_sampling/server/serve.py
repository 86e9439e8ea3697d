"""An OpenAI-compatible server for the mixture: ``dual-sampling serve``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or false),
``GET /v1/models``, ``GET /health`` (200 only while both engines run), ``GET /metrics``
(Prometheus text) and ``GET /openapi.json``. Requests and responses are vLLM's OpenAI models
extended with the mixture's fields (:mod:`dual_sampling.server.protocol`). Every choice also
carries, under the key ``dual_sampling``, the per-token records of its tokens (α, log π_t,
log π_θ, log q, the token ids) and, on its last chunk, ``log_w_theta`` and any error. The
standard ``logprobs`` report log q, the distribution actually sampled.

The teacher's view comes from extra body fields: ``teacher_prompt`` (completions) or
``teacher_messages`` (chat) replace the teacher's input; ``hint`` is rendered into the
teacher's user message with the template of ``dual-sampling generate``.

Under load: at most ``max_queue`` samples are held at once (a request of ``n`` holds ``n``);
past it a request gets 429 at once. Samples are served first come first served. A client
that disconnects, stops reading for ``send_timeout`` or outlives ``request_timeout`` has its
request aborted on both engines. A dead engine turns ``/health`` red, ends the requests in
flight with an error, makes new ones 503, and ends :func:`serve` with exit status 1 so that a
supervisor restarts it.

Bad input is a 400 (or 401, 404, 408, 413, 415) naming the field; a fault of the server itself
is a logged 500, and a stream that meets one ends with an error event and ``[DONE]``. No
response ever holds a non-finite number.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import secrets
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers

from dual_sampling.driver.dual_scheduler import SampleDelta
from dual_sampling.lockstep import RECORD_FIELDS, SyncError
from dual_sampling.options import SamplingOptions
from dual_sampling.records import SampleRecord
from dual_sampling.text import TextStream

__all__ = ["ServeOptions", "build_app", "serve"]

API_KEY_ENV = "DUAL_SAMPLING_API_KEY"
PUBLIC_ROUTES = frozenset({"/health", "/metrics", "/openapi.json"})
"""Routes served without the API key; every other path needs it (so a route added later is never open)."""
MAX_JSON_DEPTH = 32
"""Nesting of a request body's arrays and objects at most (the deepest valid request nests about 6)."""

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServeOptions:
    """How the server listens and what it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; only this machine can connect unless it is changed."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """Require ``Authorization: Bearer <key>`` on every route but /health, /metrics and /openapi.json (default: the
    DUAL_SAMPLING_API_KEY variable, if set, which keeps the key out of the process list)."""
    served_model_name: str = "dual"
    """The model name /v1/models lists and responses carry (requests may name it or leave it out)."""
    max_queue: int = 256
    """Samples held at once, running or waiting for the engines; a request past it gets 429."""
    max_n: int = 16
    """Largest n (and best_of) a request may ask for."""
    max_body_bytes: int = 1 << 20
    """Largest request body; a larger one gets 413."""
    body_timeout: float = 30.0
    """Seconds a client may take to send its request body; past it the request gets 408."""
    send_timeout: float = 30.0
    """Seconds a response may wait for its client to read; past it the request is aborted on both engines and
    the connection closed (a client that stops reading would otherwise hold its samples for good)."""
    request_timeout: float = 3600.0
    """Seconds a request may run in all; past it, it is aborted on both engines (504, or an error event)."""
    max_connections: int = 1024
    """Connections served at once (uvicorn's limit_concurrency); past it a connection gets 503."""

    def __post_init__(self) -> None:
        for name in ("port", "max_queue", "max_n", "max_body_bytes", "max_connections"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("body_timeout", "send_timeout", "request_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty: leave it out to serve without a key")
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None


class BadRequest(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class ClientTooSlow(Exception):
    """The client did not take a response's next bytes within ``send_timeout``."""


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.kind, exc.param), status_code=exc.status)


# Request fields the server acts on. Any other field of the request models must keep its default.
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
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "hint",
}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "teacher_messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "teacher_prompt", "logprobs", "best_of"}
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
    deadline: float
    """time.monotonic() past which the request is aborted."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or BadRequest naming what is wrong with it.

    Refused besides invalid JSON: NaN and ±Infinity, numbers past float64, integers past Python's
    4,300-digit limit, nesting deeper than :data:`MAX_JSON_DEPTH`, and strings with lone surrogates
    (valid JSON escapes that no tokenizer or UTF-8 writer takes).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"the number {literal[:40]} is out of range")
        return value

    def constant(literal: str) -> float:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        body = json.loads(text, parse_float=finite, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # out-of-range numbers, NaN, integers past the digit limit
        raise BadRequest(f"the request body is not valid: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse nesting past MAX_JSON_DEPTH and strings UTF-8 cannot encode, naming the field (iteratively)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{path or 'a key'} holds a lone surrogate (not valid Unicode)", path) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path, depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


class DualService:
    """The server's state: the dual engine, admission, metrics."""

    def __init__(self, dual: Any, options: ServeOptions) -> None:
        self.dual, self.options = dual, options
        self.held = 0
        """Samples accepted and not yet finished."""
        self.metrics = _Metrics(self)
        self._hint_template = None
        self._pieces: dict[int, str] = {}
        # Parsing, templating and tokenizing take long for long bodies: one thread of their own keeps the event
        # loop (and /health) free. At most max_queue requests wait for it; past that a request gets 429.
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="dual-sampling-parse")
        self.parsing = 0
        """Requests waiting for or in the parse thread."""
        tok = dual.tokenizer
        # No token covers more characters of text than its own string has (byte-level BPE and SentencePiece
        # alike), so a prompt longer than this many characters cannot fit, and is refused before tokenizing.
        self.max_prompt_chars = dual.max_model_len * max(map(len, tok.get_vocab()), default=1)

    # ------------------------------------------------------------------ parsing

    def parse(self, raw: bytes, kind: str, arrival: float) -> _Job:
        """Read, validate and translate a request body (runs in :attr:`parser`, off the event loop).

        ``arrival`` (time.monotonic()) starts the request's ``request_timeout``.
        """
        from pydantic import ValidationError
        from vllm.exceptions import VLLMClientError

        from dual_sampling.server.protocol import DualChatCompletionRequest, DualCompletionRequest

        body = parse_body(raw)
        if kind == "chat":  # the conversations' shape first: vLLM's validators raise TypeErrors on malformed ones
            for name in ("messages", "teacher_messages"):
                if name == "messages" or body.get(name) is not None:
                    _messages(body.get(name), name)
        model_cls = DualChatCompletionRequest if kind == "chat" else DualCompletionRequest
        fields = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
        # Fields the mixture does not act on are refused before vLLM's validators see them: those run on the raw
        # values (tools, structured outputs, ...) and some raise plain TypeErrors on malformed ones.
        for name in sorted(body):
            if name in fields:
                continue
            known = model_cls.model_fields.get(name)
            if known is None or body[name] not in (None, known.get_default(call_default_factory=True)):
                raise BadRequest(f"{name} is not supported by dual-sampling", name)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
            raise BadRequest(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param) from None
        except (VLLMClientError, TypeError, KeyError, AttributeError) as exc:
            # vLLM's own request checks raise their own errors, and its "before" validators meet the raw body
            # (``"messages": null``): the client's input all the same.
            raise BadRequest(f"the request is not valid: {exc}", getattr(exc, "parameter", None)) from None
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
        theta_text, teacher_text = self._prompts(req, kind)
        try:
            (teacher_ids,), (theta_ids,) = self.dual._prompt_pairs([theta_text], [teacher_text])
        except ValueError as exc:
            raise BadRequest(
                str(exc).replace("prompt 0", "the prompt"), "messages" if kind == "chat" else "prompt"
            ) from None
        room = self.dual.max_model_len - max(len(teacher_ids), len(theta_ids))
        if kind == "chat" and req.max_completion_tokens is not None:
            max_tokens_field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        elif kind == "chat":
            with warnings.catch_warnings():  # vLLM's chat model marks max_tokens deprecated; it is still honoured
                warnings.simplefilter("ignore", DeprecationWarning)
                max_tokens_field, max_tokens = "max_tokens", req.max_tokens
        else:
            max_tokens_field, max_tokens = "max_tokens", req.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(
                f"{max_tokens_field}={max_tokens} does not fit: the prompt leaves {room} of max_model_len="
                f"{self.dual.max_model_len} tokens",
                max_tokens_field,
            )
        logprobs = self._logprobs(req, kind)
        n = 1 if req.n is None else req.n
        best_of = req.best_of if kind == "completion" else None
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.options.max_n:
                raise BadRequest(f"{name}={value} exceeds this server's limit of {self.options.max_n}", name)
        if req.stream and best_of is not None and best_of != n:
            raise BadRequest("best_of cannot be combined with stream", "best_of")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            sampling = SamplingOptions(
                max_tokens=room if max_tokens is None else max_tokens,
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
            sampling.check_vocab(self.dual.vocab, self.dual.eos_token_ids)
        except ValueError as exc:
            name = str(exc).split(" ")[0]
            # The request's names for the SamplingOptions fields it names otherwise.
            renamed = {"max_tokens": max_tokens_field, "top_logprobs": "top_logprobs" if kind == "chat" else "logprobs"}
            raise BadRequest(str(exc), renamed.get(name, name)) from None
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
            arrival + self.options.request_timeout,
        )

    def _prompts(self, req: Any, kind: str) -> tuple[Any, Any]:
        """(theta's prompt, teacher's prompt): text rendered with the chat template, or token ids."""
        hint = req.hint
        if kind == "chat":
            messages = _messages(req.messages, "messages")
            teacher = _messages(req.teacher_messages, "teacher_messages") if req.teacher_messages is not None else None
            if teacher is None:
                teacher = [dict(m) for m in messages]
                if hint is not None:
                    last = max(i for i, m in enumerate(teacher) if m["role"] == "user")
                    teacher[last]["content"] = self._with_hint(teacher[last]["content"], hint)
            generation = req.add_generation_prompt
            return self._chat(messages, "messages", generation), self._chat(teacher, "teacher_messages", generation)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequest("send one prompt per request", "prompt")
            prompt = prompt[0]
        if prompt in ("", [], None):
            raise BadRequest("prompt is empty", "prompt")
        teacher = req.teacher_prompt
        if teacher is None:
            teacher = self._with_hint(prompt, hint) if hint is not None else prompt
        for name, text in (("prompt", prompt), ("teacher_prompt", teacher)):
            self._check_length(text, name)
        return prompt, teacher

    def _check_length(self, text: Any, param: str) -> None:
        if isinstance(text, str) and len(text) > self.max_prompt_chars:
            raise BadRequest(
                f"{param} has {len(text)} characters, more than max_model_len={self.dual.max_model_len} tokens "
                "can hold",
                param,
            )

    def _with_hint(self, problem: Any, hint: str) -> str:
        if not isinstance(problem, str):
            raise BadRequest("hint needs a text prompt, not token ids", "hint")
        if self._hint_template is None:
            from dual_sampling.datagen.run import DEFAULT_TEACHER_TEMPLATE, user_template

            self._hint_template = user_template(None, DEFAULT_TEACHER_TEMPLATE)
        return self._hint_template.render(problem=problem, hint=hint, row={})

    def _chat(self, messages: list[dict[str, str]], param: str, add_generation_prompt: bool) -> list[int]:
        """The conversation rendered by the chat template, as token ids (the template places any BOS itself)."""
        self._check_length("".join(m["content"] for m in messages), param)
        tok = self.dual.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # a template that refuses the conversation (roles out of order, ...)
            raise BadRequest(f"{param}: the chat template refused these messages ({exc})", param) from None
        self._check_length(text, param)  # many short messages render to more than their contents
        return tok(text, add_special_tokens=False)["input_ids"]

    @staticmethod
    def _logprobs(req: Any, kind: str) -> int | None:
        if kind == "chat":
            if not req.logprobs:
                if req.top_logprobs:
                    raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
                return None
            return int(req.top_logprobs or 0)
        return None if req.logprobs is None else int(req.logprobs)

    def piece(self, token: int) -> str:
        """One token decoded alone (cached: logprobs with alternatives decode hundreds of thousands)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.dual.tokenizer.decode([token])
        return text

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
        """(sample index, delta) from every sample of ``job``, as they come; BadRequest(504) past its deadline."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def one(index: int) -> None:
            try:
                last = None
                async for last in self.dual.stream(
                    job.theta_ids, job.teacher_ids, sampling=job.sampling, sample_key=0, sample_index=index
                ):
                    queue.put_nowait((index, last))
                if last is None or last.sample is None:  # the driver was closed under it
                    raise SyncError(f"the dual engine stopped before sample {index} ended")
            except BaseException as exc:
                queue.put_nowait((index, exc))
                raise
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(one(i)) for i in range(job.sampling.draws)]
        try:
            remaining = len(tasks)
            while remaining:
                try:
                    index, item = await asyncio.wait_for(queue.get(), max(0.0, job.deadline - time.monotonic()))
                except TimeoutError:
                    message = f"the request ran past request_timeout={self.options.request_timeout} s and was aborted"
                    raise BadRequest(message, None, 504, "timeout_error") from None
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
                task.cancel()  # aborts the samples still running on both engines
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ answers

    async def complete(self, job: _Job) -> bytes:
        """The whole response of a non-streaming request, as JSON bytes (a DualCompletionResponse or
        DualChatCompletionResponse)."""
        deltas: dict[int, list[SampleDelta]] = {}
        async for index, delta in self.samples(job):
            deltas.setdefault(index, []).append(delta)
        samples = [(i, ds) for i, ds in sorted(deltas.items())]
        if job.sampling.best_of:
            samples.sort(key=lambda item: -_score(item[1][-1].sample, job.sampling.best_of_score))
            samples = samples[: job.sampling.n]
        for _, ds in samples:
            self.metrics.observe(ds[-1].sample)
        # Assembled and written off the event loop: n=16 with 20 alternatives per token is tens of MB of JSON.
        return await asyncio.to_thread(self._render, job, [ds for _, ds in samples])

    def _render(self, job: _Job, samples: list[list[SampleDelta]]) -> bytes:
        choices = [self._choice(job, k, ds) for k, ds in enumerate(samples)]
        completion_tokens = sum(len(ds[-1].sample.token_ids) for ds in samples)
        body = {
            "id": _response_id(job),
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": job.model,
            "choices": choices,
            "usage": _usage(len(job.theta_ids) * len(samples), completion_tokens),
        }
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()

    def _choice(self, job: _Job, index: int, deltas: list[SampleDelta]) -> dict[str, Any]:
        sample = deltas[-1].sample
        records = np.concatenate([d.records for d in deltas]) if deltas else np.zeros((0, len(RECORD_FIELDS)))
        top = [d.top for d in deltas if d.top is not None]
        top_all = (np.concatenate([t[0] for t in top]), np.concatenate([t[1] for t in top])) if top else None
        extra = _records(sample.teacher_token_ids, records, sample)
        logprobs = self._logprobs_block(job, sample.teacher_token_ids, records, top_all)
        choice: dict[str, Any] = {"index": index}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": sample.text}
        else:
            choice["text"] = sample.text
        choice.update(
            logprobs=logprobs, finish_reason=sample.finish_reason, stop_reason=sample.stop_reason, dual_sampling=extra
        )
        return choice

    def _logprobs_block(
        self, job: _Job, token_ids: Sequence[int], records: np.ndarray, top: tuple[np.ndarray, np.ndarray] | None
    ) -> dict[str, Any] | None:
        if job.logprobs is None:
            return None
        logq = records[:, RECORD_FIELDS.index("logq")].tolist()
        token_ids = token_ids[: len(logq)]  # a failed row's forced token has no record
        strings = [self.piece(int(t)) for t in token_ids]
        alternatives = []
        for i in range(len(token_ids)):
            if top is None or job.logprobs == 0:
                alternatives.append([])
            else:
                alternatives.append([(self.piece(int(t)), _logprob(v)) for t, v in zip(top[0][i], top[1][i])])
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
        """Server-sent events: OpenAI chunks, then ``data: [DONE]``; a failure ends it with an error event first."""
        request_id = _response_id(job)
        created = int(time.time())
        tok = self.dual.tokenizer
        texts = {i: TextStream(tok, job.sampling.stop, job.sampling.stop_token_ids) for i in range(job.sampling.n)}
        completion_tokens = 0
        if job.kind == "chat":
            for i in range(job.sampling.n):
                yield _sse(_chunk(job, request_id, created, i, {"role": "assistant", "content": ""}))
        try:
            # aclosing: however this stream ends, its samples are aborted before the caller releases their room.
            async with contextlib.aclosing(self.samples(job)) as samples:
                async for index, delta in samples:
                    extra = _records(delta.token_ids, delta.records, delta.sample)
                    logprobs = self._logprobs_block(job, delta.token_ids, delta.records, delta.top)
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
        except SyncError as exc:
            yield _sse(error_body(str(exc), 503, "service_unavailable"))
        except BadRequest as exc:
            yield _sse(error_body(exc.message, exc.status, exc.kind, exc.param))
        except Exception:
            logger.exception("a stream failed inside the server")
            self.metrics.server_errors.inc()
            yield _sse(error_body("internal server error (logged)", 500, "internal_server_error"))
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
        """Both engines run: none exited, and vLLM declared none dead (the driver's ``alive``)."""
        scheduler = self.dual.scheduler
        return scheduler.alive and scheduler.engines is not None and scheduler.engines.dead() is None


class _Reservation:
    """Room held for one request's samples; released once, however the request ends."""

    def __init__(self, service: DualService, draws: int) -> None:
        self.service, self.draws = service, draws

    def release(self) -> None:
        if self.draws:
            self.service.held -= self.draws
            self.draws = 0


# ---------------------------------------------------------------------- helpers


def _messages(messages: Any, param: str) -> list[dict[str, str]]:
    """Plain {role, content} messages; content parts are joined. Refuses what a text model cannot take (tool calls,
    images, ...) rather than dropping it."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"{param} must be a non-empty list of messages", param)
    out = []
    for i, message in enumerate(messages):
        m = dict(message) if isinstance(message, dict) else getattr(message, "__dict__", None)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{param}[{i}] must be an object with a role", f"{param}[{i}]")
        for key in sorted(set(m) - {"role", "content"}):
            if m[key] is not None:
                raise BadRequest(f"{param}[{i}].{key} is not supported by dual-sampling", f"{param}[{i}].{key}")
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


def _logprob(value: float) -> float:
    """An alternative's log q: -inf (filtered out by top-k, top-p or min-p) is sent as -9999.0, as vLLM does."""
    return float(value) if math.isfinite(value) else -9999.0


def _score(sample: SampleRecord, name: str) -> float:
    values = getattr(sample, name)
    return math.fsum(values) if sample.error is None else -math.inf


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _response_id(job: _Job) -> str:
    return f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _chunk_object(job: _Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


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
    # allow_nan=False: a non-finite value would be bare NaN, which is not JSON; it is a bug upstream, and raises.
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


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
        self.server_errors = Counter(
            "dual_sampling_server_errors",
            "Faults of the server itself (500s and failed streams)",
            registry=self.registry,
        )
        self.send_timeouts = Counter(
            "dual_sampling_send_timeouts",
            "Requests aborted because their client stopped reading for send_timeout",
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


def _route_path(scope: dict[str, Any]) -> str:
    """The path the router matches: without the app's mount prefix, whether or not a proxy stripped it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _authorized(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guessed key was right.
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


class _Guard:
    """ASGI middleware, before any route: the API key, the body's size and type, and a bound on unread output."""

    def __init__(self, app: Any, options: ServeOptions, service: DualService) -> None:
        self.app, self.options, self.service = app, options, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = None
        if (
            self.options.api_key
            and _route_path(scope) not in PUBLIC_ROUTES
            and not _authorized(headers.get("authorization"), self.options.api_key)
        ):
            refusal = BadRequest(
                "a valid API key is required (Authorization: Bearer <key>)", None, 401, "authentication_error"
            )
        elif scope["method"] == "POST":
            length = headers.get("content-length")
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if length is not None and length.isdigit() and int(length) > self.options.max_body_bytes:
                refusal = BadRequest(f"the request body exceeds {self.options.max_body_bytes} bytes", None, 413)
            elif media != "application/json":
                # A browser page may POST text/plain to localhost without asking first; JSON it must ask for.
                refusal = BadRequest(
                    f"Content-Type must be application/json, got {media or 'none'!r}",
                    "Content-Type",
                    415,
                )
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        timeout = self.options.send_timeout

        async def send_in_time(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except TimeoutError:
                raise ClientTooSlow(f"the client read nothing for send_timeout={timeout} s") from None

        try:
            await self.app(scope, receive, send_in_time)
        except ClientTooSlow as exc:
            # Raised through the response, whose request was aborted on the way out; returning leaves the
            # connection to uvicorn, which closes it (the response cannot be completed).
            self.service.metrics.send_timeouts.inc()
            logger.warning("%s %s: %s; request aborted", scope["method"], scope["path"], exc)


def build_app(dual: Any, options: ServeOptions | None = None, on_engine_death: Callable[[], None] | None = None):
    """The FastAPI app serving ``dual`` (an open :class:`OptimalSamplingDual`).

    ``on_engine_death`` is called once when the engines fail for good (:func:`serve` uses it to exit).
    """
    from dual_sampling.server import protocol

    options = options or ServeOptions()
    service = DualService(dual, options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        watch = asyncio.ensure_future(_watch_engines(service, on_engine_death)) if on_engine_death else None
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
            service.parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dual-sampling", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.service = service
    app.add_middleware(_Guard, options=options, service=service)

    async def body_of(request: Request) -> bytes:
        chunks, size = [], 0
        try:
            async with asyncio.timeout(options.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > options.max_body_bytes:
                        raise BadRequest(f"the request body exceeds {options.max_body_bytes} bytes", None, 413)
                    chunks.append(chunk)
        except TimeoutError:
            message = f"the request body took longer than body_timeout={options.body_timeout} s"
            raise BadRequest(message, None, 408) from None
        return b"".join(chunks)

    class EventStream(StreamingResponse):
        """Server-sent events whose samples are aborted and reservation released however the response ends."""

        def __init__(self, events: _Events, reservation: _Reservation) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.events, self.reservation = events, reservation

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                try:
                    await self.events.aclose()  # aborts its samples on both engines if they still run
                except Exception:
                    logger.exception("closing a stream failed")
                finally:
                    if not self.events.completed:
                        service.metrics.disconnects.inc()
                    self.reservation.release()

    async def handle(request: Request, kind: str, route: str):
        def answer(exc: BadRequest) -> JSONResponse:
            service.metrics.requests.labels(route, str(exc.status)).inc()
            return error_response(exc)

        arrival = time.monotonic()
        try:
            raw = await body_of(request)
            if service.parsing >= options.max_queue:
                raise BadRequest(
                    f"{service.parsing} requests wait to be read, the most is {options.max_queue}; retry later",
                    None,
                    429,
                    "rate_limit_error",
                )
            service.parsing += 1
            try:
                loop = asyncio.get_running_loop()
                job = await loop.run_in_executor(service.parser, service.parse, raw, kind, arrival)
            finally:
                service.parsing -= 1
            reservation = service.admit(job)
        except BadRequest as exc:
            return answer(exc)
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
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
            try:
                body = task.result()
            except SyncError as exc:
                return answer(BadRequest(str(exc), None, 503, "service_unavailable"))
            except BadRequest as exc:
                return answer(exc)
            service.metrics.requests.labels(route, "200").inc()
            return Response(body, media_type="application/json")
        finally:
            watcher.cancel()
            if not task.done():  # this handler itself was cancelled: its samples are aborted before their room goes
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            reservation.release()

    async def route(request: Request, kind: str, name: str):
        try:
            return await handle(request, kind, name)
        except Exception:
            logger.exception("%s %s failed inside the server", request.method, request.url.path)
            service.metrics.server_errors.inc()
            service.metrics.requests.labels(name, "500").inc()
            return JSONResponse(
                error_body("internal server error (logged)", 500, "internal_server_error"), status_code=500
            )

    def body_schema(model: type) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": _schema_ref(model)}}}}

    error_responses = {
        status: {"model": protocol.ErrorResponse, "description": what}
        for status, what in (
            (400, "invalid input, naming the field"),
            (401, "no valid API key"),
            (404, "another model"),
            (408, "the body came too slowly"),
            (413, "the body is too large"),
            (415, "not application/json"),
            (429, "the queue is full"),
            (503, "the engines are not running"),
            (504, "request_timeout passed"),
        )
    }

    @app.post(
        "/v1/chat/completions",
        response_model=protocol.DualChatCompletionResponse,
        responses=error_responses,
        openapi_extra=body_schema(protocol.DualChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        return await route(request, "chat", "chat")

    @app.post(
        "/v1/completions",
        response_model=protocol.DualCompletionResponse,
        responses=error_responses,
        openapi_extra=body_schema(protocol.DualCompletionRequest),
    )
    async def completions(request: Request):
        return await route(request, "completion", "completions")

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

    _add_request_schemas(app, [protocol.DualChatCompletionRequest, protocol.DualCompletionRequest])
    return app


def _schema_ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _add_request_schemas(app: FastAPI, models: list[type]) -> None:
    """Put the request models (read by hand from the body, so unknown to FastAPI) into /openapi.json."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                own = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(own.pop("$defs", {}))
                components[model.__name__] = own
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _watch_engines(service: DualService, on_death: Callable[[], None]) -> None:
    """Call ``on_death`` once the engines have failed for good (a dead process or a dead EngineCore)."""
    while service.healthy():
        await asyncio.sleep(0.5)
    logger.error("the engines failed: %s; stopping the server", service.dual.scheduler.failure)
    on_death()


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


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(dual: Any, options: ServeOptions) -> None:
    """Serve ``dual`` until interrupted (blocking); raises SystemExit(1) if the engines die, as ``vllm serve`` exits."""
    import uvicorn

    if not options.api_key and not _loopback(options.host):
        logger.warning(
            "serving on %s without an API key: anyone who reaches this address can use the engines "
            "(set --api-key or %s)",
            options.host,
            API_KEY_ENV,
        )
    server: uvicorn.Server | None = None
    died = False

    def stop() -> None:
        nonlocal died
        died = True
        server.should_exit = True

    config = uvicorn.Config(
        build_app(dual, options, on_engine_death=stop),
        host=options.host,
        port=options.port,
        log_level="info",
        timeout_graceful_shutdown=5,
        limit_concurrency=options.max_connections,
    )
    server = uvicorn.Server(config)
    server.run()
    if died:
        raise SystemExit(1)
