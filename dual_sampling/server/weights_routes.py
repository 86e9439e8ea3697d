"""vLLM's RL routes, for the theta engine: ``/pause``, ``/resume``, ``/is_paused``, ``/update_weights`` (from a
folder), ``/update_weight_version`` and ``/weight_info``.

The route names and bodies are vLLM's where they fit, so a trainer that drives a vLLM server drives this one.
Two differ: ``/pause`` has no ``keep`` mode (requests frozen across an update would be drawn from two θ), and
``/update_weights`` names a folder in ``update_info`` instead of a weight-transfer engine's payload. A folder
outside the server's ``weights_dirs`` is refused (403), so a client cannot make the server read any path. A label
theta's weights carried before is refused by both labelling routes (400): records and ``best_of`` tell weights
apart by their labels.
The routes are served only with an API key (the guard lets only /health, /metrics and /openapi.json by without
it): a keyless server would let anyone who reaches its port, or a web page by DNS rebinding, pause it or relabel θ.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dual_sampling.lockstep import SyncError
from dual_sampling.server.serve_options import ServeOptions
from dual_sampling.server.wire import BadRequest, error_response, invalid_field, parse_body

__all__ = ["add_weight_routes", "allowed_weights_path"]


def allowed_weights_path(path: str, weights_dirs: list[str]) -> Path:
    """``path`` resolved (symlinks followed) if it lies inside one of ``weights_dirs``; else BadRequest (403)."""
    resolved = Path(path).resolve()
    for directory in weights_dirs:
        if resolved.is_relative_to(Path(directory).resolve()):
            return resolved
    where = f"outside {sorted(weights_dirs)}" if weights_dirs else "refused: the server has no weights_dirs"
    raise BadRequest(
        f"update_info.weights_path {path!r} is {where}, the folders it loads weights from",
        "update_info.weights_path",
        403,
        "permission_error",
    )


def add_weight_routes(
    app: FastAPI, dual: Any, options: ServeOptions, read_body: Callable[[Request], Awaitable[bytes]]
) -> None:
    """Add the routes to ``app``, serving ``dual`` (an open OptimalSamplingDual)."""
    from dual_sampling.server.protocol import UpdateWeightsRequest, UpdateWeightVersionRequest

    async def answer(work: Callable[[], Awaitable[dict[str, Any]]]) -> JSONResponse:
        try:
            return JSONResponse(await work())
        except BadRequest as exc:
            return error_response(exc)
        except ValidationError as exc:
            return error_response(invalid_field(exc))
        except SyncError as exc:
            return error_response(BadRequest(str(exc), None, 503, "service_unavailable"))
        except ValueError as exc:  # the weights themselves: a tensor missing, extra, misshapen or not finite
            return error_response(BadRequest(str(exc), "update_info.weights_path"))

    async def body(request: Request, model: type) -> Any:
        return model.model_validate(parse_body(await read_body(request)))

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        async def work():
            if mode not in ("wait", "abort"):
                raise BadRequest(
                    f"mode must be 'wait' or 'abort', got {mode!r} ('keep' would draw the frozen requests from two θ)",
                    "mode",
                )
            await dual.pause_async(mode)
            return {"status": "paused"}

        return await answer(work)

    @app.post("/resume")
    async def resume():
        async def work():
            await dual.resume_async()
            return {"status": "resumed"}

        return await answer(work)

    @app.get("/is_paused")
    async def is_paused():
        return JSONResponse({"is_paused": dual.paused})

    # A label is checked unused before the weights load and taken after: one labelling route at a time, so two
    # clients cannot both find a label free and give it to two sets of weights.
    labelling = asyncio.Lock()

    @app.post("/update_weights")
    async def update_weights(request: Request):
        async def work():
            req = await body(request, UpdateWeightsRequest)
            path = allowed_weights_path(req.update_info.weights_path, options.weights_dirs)
            async with labelling:
                if req.weight_version is not None:
                    # update_theta takes any label (the caller's to keep unique); a client may not reuse one.
                    try:
                        dual.driver.versions.check_new("theta", req.weight_version)
                    except ValueError as exc:
                        raise BadRequest(str(exc), "weight_version") from exc
                version = await dual.update_theta_async(
                    path, version=req.weight_version, mode=req.mode, follow_symlinks=False
                )
            return {"message": "Weights updated", "weight_version": version}

        return await answer(work)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        async def work():
            req = await body(request, UpdateWeightVersionRequest)
            async with labelling:
                try:
                    await dual.set_weight_version_async("theta", req.new_version)
                except ValueError as exc:  # a label earlier weights carried
                    raise BadRequest(str(exc), "new_version") from exc
            return {"success": True, "new_version": req.new_version}

        return await answer(work)

    @app.get("/weight_info")
    async def weight_info():
        versions = dual.weight_versions
        return JSONResponse({"weight_version": versions["theta"], "teacher_weight_version": versions["teacher"]})
