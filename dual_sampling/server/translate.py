"""Request → job: a request body read into the request models, refused where it asks for what the mixture does
not do, its prompts (and the teacher's) rendered and tokenized, and its fields translated into
:class:`~dual_sampling.options.SamplingOptions`; the result is a :class:`Job`."""

from __future__ import annotations

import secrets
import warnings
from dataclasses import dataclass
from typing import Any

from dual_sampling.options import SamplingOptions
from dual_sampling.prompts import DEFAULT_TEACHER_TEMPLATE, user_template
from dual_sampling.roster import PAIR
from dual_sampling.server.serve_options import ServeOptions
from dual_sampling.server.wire import BadRequest, invalid_field, parse_body

__all__ = ["Job", "Translator"]

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
    "teachers",
    "dense_logprobs",
    "use_beam_search",
    "length_penalty",
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


@dataclass
class Job:
    """A parsed request: one prompt pair, its sampling options, and how to answer."""

    kind: str
    """"chat" or "completion"."""
    theta_ids: list[int]
    teacher_ids: list[int] | dict[str, list[int]]
    """The teacher's prompt; with several teachers, each named teacher's (the others see theta's)."""
    columns: tuple[str, ...]
    """The per-token record columns of its records, in the order of a delta's: the server's roster's, but a left-out
    teacher's log π (:func:`~dual_sampling.driver.requests.request_columns`)."""
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    logprobs: int | None
    """None: no logprobs; k >= 0: the sampled token's log q and k alternatives."""
    model: str
    deadline: float
    """time.monotonic() past which the request is aborted."""
    teachers: tuple[str, ...] | None = None
    """The teachers the request mixes (its ``teachers``), in roster order; None: all."""


class Translator:
    """Reads request bodies into jobs for one dual engine (the bound on prompt length is worked out once)."""

    def __init__(self, dual: Any, options: ServeOptions) -> None:
        self.dual, self.options = dual, options
        self._hint_template = None
        tok = dual.tokenizer
        # No token covers more characters of text than its own string has (byte-level BPE and SentencePiece
        # alike), so a prompt longer than this many characters cannot fit, and is refused before tokenizing.
        self.max_prompt_chars = dual.max_model_len * max(map(len, tok.get_vocab()), default=1)

    def parse(self, raw: bytes, kind: str, arrival: float) -> Job:
        """Read, validate and translate a request body (runs in the service's parse thread, off the event loop).

        ``arrival`` (time.monotonic()) starts the request's ``request_timeout``.
        """
        from pydantic import ValidationError
        from vllm.exceptions import VLLMClientError

        from dual_sampling.server.protocol import DualChatCompletionRequest, DualCompletionRequest

        body = parse_body(raw)
        if kind == "chat":  # the conversations' shape first: vLLM's validators raise TypeErrors on malformed ones
            _messages(body.get("messages"), "messages")
            teacher = body.get("teacher_messages")
            for name, conversation in teacher.items() if isinstance(teacher, dict) else [(None, teacher)]:
                if conversation is not None:
                    _messages(conversation, "teacher_messages" + ("" if name is None else f".{name}"))
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
            raise invalid_field(exc) from None
        except (VLLMClientError, TypeError, KeyError, AttributeError) as exc:
            # vLLM's own request checks raise their own errors, and its "before" validators meet the raw body
            # (``"messages": null``): the client's input all the same.
            raise BadRequest(f"the request is not valid: {exc}", getattr(exc, "parameter", None)) from None
        if req.model not in (None, self.options.served_model_name):
            raise BadRequest(
                f"model {req.model!r} is not served here; use {self.options.served_model_name!r}",
                "model",
                404,
                "not_found_error",
            )
        theta_text, teacher_text = self._prompts(req, kind)
        try:
            pair = self.dual.prepare(theta_text, teacher_text)
        except ValueError as exc:
            message = str(exc).replace("prompt 0", "the prompt")
            raise (
                _named_error(message, kind, "max_tokens")
                if message.startswith("teacher_prompts")
                else BadRequest(message, "messages" if kind == "chat" else "prompt")
            ) from None
        if kind == "chat" and req.max_completion_tokens is not None:
            max_tokens_field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        elif kind == "chat":
            with warnings.catch_warnings():  # vLLM's chat model marks max_tokens deprecated; it is still honoured
                warnings.simplefilter("ignore", DeprecationWarning)
                max_tokens_field, max_tokens = "max_tokens", req.max_tokens
        else:
            max_tokens_field, max_tokens = "max_tokens", req.max_tokens
        if max_tokens is not None and max_tokens > pair.room:
            raise BadRequest(
                f"{max_tokens_field}={max_tokens} does not fit: the prompt leaves {pair.room} of max_model_len="
                f"{self.dual.max_model_len} tokens",
                max_tokens_field,
            )
        logprobs = self._logprobs(req, kind)
        n = 1 if req.n is None else req.n
        best_of = req.best_of if kind == "completion" else None
        dense = req.dense_logprobs or 0
        if dense and self.dual.roster != PAIR:
            raise BadRequest(
                "dense_logprobs: several teachers' top k is served by the Python API only", "dense_logprobs"
            )
        if dense > self.dual.max_dense_logprobs:
            raise BadRequest(
                f"dense_logprobs={dense} exceeds this server's --max-dense-logprobs={self.dual.max_dense_logprobs}",
                "dense_logprobs",
            )
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.options.max_n:
                raise BadRequest(f"{name}={value} exceeds this server's limit of {self.options.max_n}", name)
        if req.stream and best_of is not None and best_of != n:
            raise BadRequest("best_of cannot be combined with stream", "best_of")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            sampling = SamplingOptions(
                max_tokens=pair.room if max_tokens is None else max_tokens,
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
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                seed=secrets.randbits(62) if req.seed is None else req.seed,
                top_logprobs=logprobs or 0,
                dense_logprobs=dense,
                use_beam_search=bool(req.use_beam_search),
                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            )
            sampling.check_vocab(self.dual.vocab, self.dual.eos_token_ids)
        except ValueError as exc:
            raise _named_error(str(exc), kind, max_tokens_field) from None
        teachers = None
        if req.teachers is not None:
            try:
                teachers = self.dual.teacher_set(req.teachers)
            except ValueError as exc:
                raise BadRequest(str(exc), "teachers") from None
            if sampling.use_beam_search:
                raise BadRequest("teachers: beam search runs every teacher", "teachers")
        try:
            self.dual.check(pair, sampling, teachers)  # what this engine serves (mode="speculative" serves less)
        except ValueError as exc:
            raise _named_error(str(exc), kind, max_tokens_field) from None
        if sampling.use_beam_search and req.stream:
            raise BadRequest("use_beam_search cannot be combined with stream", "stream")
        stream_options = getattr(req, "stream_options", None)
        return Job(
            kind,
            pair.theta_ids,
            pair.teacher_ids,
            self.dual.roster.token_columns if teachers is None else self.dual.record_columns(teachers),
            sampling,
            bool(req.stream),
            bool(stream_options and stream_options.include_usage),
            logprobs,
            self.options.served_model_name,
            arrival + self.options.request_timeout,
            teachers,
        )

    def _prompts(self, req: Any, kind: str) -> tuple[Any, Any]:
        """(theta's prompt, the teacher's): text rendered with the chat template, or token ids. With several teachers
        the teacher's is ``{teacher name: prompt}`` of the teachers given their own (the others see theta's)."""
        field = "teacher_messages" if kind == "chat" else "teacher_prompt"
        teachers = self._per_teacher(field, getattr(req, field))
        hints = self._per_teacher("hint", req.hint)
        if kind == "chat":
            messages = _messages(req.messages, "messages")
            generation = req.add_generation_prompt
            own = {}
            for name in self.dual.roster.teachers:
                if teachers.get(name) is not None:
                    conversation = _messages(teachers[name], _name(field, name, req))
                elif hints.get(name) is not None:
                    conversation = [dict(m) for m in messages]
                    last = max(i for i, m in enumerate(conversation) if m["role"] == "user")
                    conversation[last]["content"] = self._with_hint(conversation[last]["content"], hints[name])
                else:
                    continue
                own[name] = self._chat(conversation, _name(field, name, req), generation)
            return self._chat(messages, "messages", generation), own
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequest("send one prompt per request", "prompt")
            prompt = prompt[0]
        if prompt in ("", [], None):
            raise BadRequest("prompt is empty", "prompt")
        self._check_length(prompt, "prompt")
        own = {}
        for name in self.dual.roster.teachers:
            if teachers.get(name) is not None:
                own[name] = teachers[name]
            elif hints.get(name) is not None:
                own[name] = self._with_hint(prompt, hints[name])
            else:
                continue
            self._check_length(own[name], _name(field, name, req))
        return prompt, own

    def _per_teacher(self, field: str, value: Any) -> dict[str, Any]:
        """A request's teacher setting as ``{teacher name: value}`` (the roster's rules: one value for every teacher,
        or a mapping naming some of several)."""
        try:
            return self.dual.roster.per_teacher(field, value)
        except ValueError as exc:
            raise BadRequest(str(exc), field) from None

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
        if self._hint_template is None:  # compiled on first use: jinja2 is imported only then
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


def _name(field: str, teacher: str, req: Any) -> str:
    """The request's name of ``field``'s value for ``teacher``: ``field`` itself when one value goes to every
    teacher, ``field.teacher`` when it is given per teacher name."""
    return f"{field}.{teacher}" if isinstance(getattr(req, field), dict) else field


def _named_error(message: str, kind: str, max_tokens_field: str) -> BadRequest:
    """A 400 for a SamplingOptions or engine check's message, in the request's own words: the field it begins with
    renamed as the request names it (so a completion's message says logprobs where the options say top_logprobs)."""
    field = message.split(" ")[0].rstrip(":")
    name = _request_field(message, kind, max_tokens_field)
    return BadRequest(name + message[len(field) :] if name != field else message, name)


def _request_field(message: str, kind: str, max_tokens_field: str) -> str:
    """The request's name for the field a SamplingOptions or engine check's message begins with ("top_logprobs ...",
    "prompt: ..."): a completion asks for logprobs where a chat asks for top_logprobs, and a chat's prompt is its
    messages."""
    name = message.split(" ")[0].rstrip(":").split("[")[0]  # teacher_prompts[0] and ['math'][0]: one field
    chat = kind == "chat"
    renamed = {
        "max_tokens": max_tokens_field,
        "top_logprobs": "top_logprobs" if chat else "logprobs",
        "prompt": "messages" if chat else "prompt",
        "teacher_prompts": "teacher_messages" if chat else "teacher_prompt",
    }
    return renamed.get(name, name)


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
