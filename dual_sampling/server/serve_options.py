"""The server's settings: :class:`ServeOptions` (address, API key, and the bounds on load and on slow clients,
which ``dual-sampling serve`` turns into flags) and the environment variable the API key may come from."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dual_sampling.checks import need_int, need_number

__all__ = ["API_KEY_ENV", "ServeOptions"]

API_KEY_ENV = "DUAL_SAMPLING_API_KEY"


@dataclass(kw_only=True)
class ServeOptions:
    """How the server listens and what it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; only this machine can connect unless it is changed."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = field(default=None, repr=False)  # a logged repr must not show the key
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
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request head: from its opening, from the first byte after a response,
    or from a response sent before the request's body arrived whole; past it the connection is closed (a silent or
    dripping socket would otherwise hold one of ``max_connections`` for good)."""
    weights_dirs: list[str] = field(default_factory=list)
    """Folders from which ``POST /update_weights`` may load theta's new weights (a path is resolved, symlinks
    followed, before it is checked); none: weight updates over HTTP are refused. Needs ``api_key``: without a key
    the weight routes (/pause, /resume, /update_weights, /update_weight_version, ...) are not served at all."""

    def __post_init__(self) -> None:
        for name in ("port", "max_queue", "max_n", "max_body_bytes", "max_connections"):
            need_int(name, getattr(self, name), 1)
        for name in ("body_timeout", "send_timeout", "request_timeout", "header_timeout"):  # seconds
            need_number(name, getattr(self, name), positive=True)
        if self.api_key == "":
            raise ValueError("api_key must not be empty: leave it out to serve without a key")
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.weights_dirs and not self.api_key:
            # Anyone reaching the port (a web page too, by DNS rebinding) could pause the server or load weights.
            raise ValueError("weights_dirs needs an api_key: without one the weight routes are not served")
