"""How uvicorn runs the app: :func:`uvicorn_config`, with a deadline on every request head.

uvicorn counts every open connection against ``limit_concurrency`` from the moment it is accepted, and times no
request head: its keep-alive timeout runs from a response to the next byte, and any byte stops it. So sockets that
never sent a byte, or that dripped a second head a byte at a time after a first request, or the body of a request
already answered (413, 401, 408), held their seats for good, ``max_connections`` of them gave every later client 503.
The protocol class here (uvicorn's own, as ``http="auto"`` picks it, with one timer added) closes a connection whose
next request head is not complete ``header_timeout`` seconds after the connection opened, after the first byte that
follows a response, or after a response sent before its request's body arrived whole (what comes then is the rest
of that body, which uvicorn reads and drops, and it too must end and be followed by a head in time). A connection
that stays silent after a response is left to uvicorn's keep-alive timeout, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dual_sampling.server.serve_options import ServeOptions

__all__ = ["head_deadline_protocol", "uvicorn_config"]


def head_deadline_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class, closing a connection whose next request head is not complete within
    ``header_timeout`` seconds (see the module docstring for when the time starts)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        # uvicorn's h11 and httptools protocols alike set `cycle` to a new RequestResponseCycle once a request head
        # is complete; a head arrived since the deadline was set if `cycle` is no longer the one it was set after.
        _head_deadline: asyncio.TimerHandle | None = None
        _timed_after: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._time_next_head()

        def data_received(self, data: bytes) -> None:
            if self._head_deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._time_next_head()  # the first byte after a response: the next request's head has begun
            super().data_received(data)
            if self._head_deadline is not None and self.cycle is not self._timed_after:
                self._stop_timing()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # `cycle` is the answered request unless a pipelined head came after it; more_body: its body is unread.
            answered = self.cycle
            if answered.response_complete and answered.more_body and self._head_deadline is None:
                self._time_next_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timing()
            super().connection_lost(exc)

        def _time_next_head(self) -> None:
            if not self.transport.is_closing():
                self._timed_after = self.cycle
                self._head_deadline = self.loop.call_later(header_timeout, self._close_if_no_head)

        def _stop_timing(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _close_if_no_head(self) -> None:
            self._head_deadline = None
            if self.cycle is self._timed_after and not self.transport.is_closing():
                self.transport.close()

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
