"""How uvicorn runs the app: :func:`uvicorn_config`, with a deadline on a new connection's request head.

uvicorn counts every open connection against ``limit_concurrency`` from the moment it is accepted, and has no
timeout before a request head arrives (its keep-alive timeout starts only after a response). So sockets that never
send a byte, ``max_connections`` of them, gave every later client 503, before any authentication. The protocol class
here (uvicorn's own, as ``http="auto"`` picks it, with one timer added) closes a connection whose first request head
is not complete within ``header_timeout`` seconds; a connection that has made a request is left to uvicorn's
keep-alive timeout as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dual_sampling.server.serve_options import ServeOptions

__all__ = ["head_deadline_protocol", "uvicorn_config"]


def head_deadline_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class, closing a connection with no complete request head after ``header_timeout``
    seconds."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_deadline = self.loop.call_later(header_timeout, self._close_if_no_request)

        def _close_if_no_request(self) -> None:
            # uvicorn sets `cycle` once a request head is complete; until then the connection has asked for nothing.
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

    return HeadDeadlineProtocol


def uvicorn_config(app: Any, options: ServeOptions, **overrides: Any) -> Any:
    """The uvicorn.Config that serves ``app`` as ``options`` say (``overrides``: uvicorn settings of the caller's)."""
    import uvicorn

    settings = dict(
        host=options.host,
        port=options.port,
        limit_concurrency=options.max_connections,
        http=head_deadline_protocol(options.header_timeout),
    )
    return uvicorn.Config(app, **{**settings, **overrides})
