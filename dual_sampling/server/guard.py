"""The ASGI middleware in front of every route (:class:`Guard`): the API key, checked in constant time; without a
key, the Host header; a POST's declared size and content type; and a bound on how long a response may wait for its
client to read."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from typing import Any

from starlette.datastructures import Headers

from dual_sampling.server.metrics import Metrics
from dual_sampling.server.serve_options import ServeOptions
from dual_sampling.server.wire import BadRequest, error_response

__all__ = ["PUBLIC_ROUTES", "ClientTooSlow", "Guard"]

PUBLIC_ROUTES = frozenset({"/health", "/metrics", "/openapi.json"})
"""Routes served without the API key; every other path needs it (so a route added later is never open)."""

logger = logging.getLogger(__name__)


class ClientTooSlow(Exception):
    """The client did not take a response's next bytes within ``send_timeout``."""


def _route_path(scope: dict[str, Any]) -> str:
    """The path the router matches: without the app's mount prefix, whether or not a proxy stripped it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _authorized(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guessed key was right.
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def _host_without_a_name(header: str | None) -> bool:
    """Whether a Host header names this machine without a DNS name: an IP literal or ``localhost`` (any port).

    A web page can make the browser send requests to a keyless server by DNS rebinding: its own name, resolved again
    to 127.0.0.1 after the page loaded, makes the requests same-origin, so the page reads the answers too. Such a
    request still carries the page's name in Host; refusing every other name defeats the attack, and a client that
    reaches the server by address (or as localhost) is unaffected.
    """
    host = (header or "").strip()
    if host.startswith("["):  # [v6] or [v6]:port, and nothing else after the bracket
        inside, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return False
        host = inside
    elif host.count(":") == 1:  # name:port or v4:port
        host, _, port = host.partition(":")
        if not port.isdigit():
            return False
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware, before any route: the API key, the body's size and type, and a bound on unread output."""

    def __init__(self, app: Any, options: ServeOptions, metrics: Metrics) -> None:
        self.app, self.options, self.metrics = app, options, metrics

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
        elif not self.options.api_key and not _host_without_a_name(headers.get("host")):
            refusal = BadRequest(
                f"Host {headers.get('host')!r} refused: a server without an API key answers only requests addressed to "
                "an IP address or localhost (a DNS name could be a web page rebinding its name to this machine); "
                "set an API key to serve by name",
                "Host",
                421,
                "misdirected_request",
            )
        elif scope["method"] == "POST":
            length = headers.get("content-length")
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if length is not None and length.isdigit() and int(length) > self.options.max_body_bytes:
                refusal = BadRequest(f"the request body exceeds {self.options.max_body_bytes} bytes", None, 413)
            elif media != "application/json" and not (self.options.api_key and _bodiless(headers)):
                # A browser page may POST text/plain to localhost without asking first; JSON it must ask for. With a
                # key, the Authorization header makes a browser ask first anyway, so a POST without a body (vLLM's
                # clients send /pause and /resume so) needs no type.
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
            self.metrics.send_timeouts.inc()
            logger.warning("%s %s: %s; request aborted", scope["method"], scope["path"], exc)


def _bodiless(headers: Any) -> bool:
    """A request that announces no body: no Content-Length (or 0) and no Transfer-Encoding."""
    return headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
