"""The HTTP app and its process: :func:`build_app` (the routes, each request's body read under its limits, the
request models in /openapi.json, the watch on the engines) and :func:`serve`, which runs it under uvicorn until
it is interrupted or the engines die."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dual_sampling.lockstep import SyncError
from dual_sampling.server.connections import uvicorn_config
from dual_sampling.server.guard import Guard
from dual_sampling.server.serve_options import API_KEY_ENV, ServeOptions
from dual_sampling.server.serving import DualService, Reservation
from dual_sampling.server.weights_routes import add_weight_routes
from dual_sampling.server.wire import BadRequest, error_body, error_response

__all__ = ["build_app", "serve"]

logger = logging.getLogger(__name__)


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
    app.add_middleware(Guard, options=options, metrics=service.metrics)

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

        def __init__(self, events: _Events, reservation: Reservation) -> None:
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
        response_model=protocol.response_model("chat", dual.roster),
        responses=error_responses,
        openapi_extra=body_schema(protocol.DualChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        return await route(request, "chat", "chat")

    @app.post(
        "/v1/completions",
        response_model=protocol.response_model("completion", dual.roster),
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
            {"status": "unavailable", "reason": str(dual.failure or "an engine is dead")}, status_code=503
        )

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    if options.api_key:  # no key, no weight routes: anyone reaching the port could pause or relabel θ
        add_weight_routes(app, dual, options, body_of)
    _add_request_schemas(
        app,
        [
            protocol.DualChatCompletionRequest,
            protocol.DualCompletionRequest,
            protocol.UpdateWeightsRequest,
            protocol.UpdateWeightVersionRequest,
        ],
    )
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
    logger.error("the engines failed: %s; stopping the server", service.dual.failure)
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

    config = uvicorn_config(
        build_app(dual, options, on_engine_death=stop), options, log_level="info", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    server.run()
    if died:
        raise SystemExit(1)
