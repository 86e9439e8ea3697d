"""The edge's JSON: a request body parsed strictly (:func:`parse_body` refuses what JSON allows but no field can
take), :class:`BadRequest` for every refusal, and the OpenAI-style error bodies refusals become."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["MAX_JSON_DEPTH", "BadRequest", "error_body", "error_response", "invalid_field", "parse_body"]

MAX_JSON_DEPTH = 32
"""Nesting of a request body's arrays and objects at most (the deepest valid request nests about 6)."""


class BadRequest(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def invalid_field(exc: Any) -> BadRequest:
    """The refusal for a pydantic ValidationError: its first error, naming the field's path in the body."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return BadRequest(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param)


def error_response(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.kind, exc.param), status_code=exc.status)


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
