"""vLLM's RL routes, for the theta engine: ``/pause``, ``/resume``, ``/is_paused``, the weight-transfer protocol
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/start_draft_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/shutdown_weight_transfer_engine``, ``/get_world_size``), ``/update_weight_version``
and ``/weight_info``.

The route names and bodies are vLLM's, so a trainer that drives a vLLM server drives this one (TRL's async GRPO
``VLLMClient``, with the shared-memory engine's chunks: :mod:`processors.weight_transfer`). The protocol's routes
call θ's :class:`~dual_sampling.driver.weight_sync.WeightSync`: each chunk is copied and checked as it comes, and the
update loads at finish, so a refused chunk or update changes nothing. The routes update θ, as all of them do here
(vLLM's ``/start_weight_update`` would update the target, the teacher): in ``mode="speculative"``, where θ is the
engine's draft model, ``/start_draft_weight_update`` starts the same update (vLLM's name for a draft's), and a server
whose θ has an engine of its own has no draft model and refuses it.

``/update_weights`` also takes a folder, in one call, for this server's earlier callers: its ``update_info`` names
``weights_path``, which no weight-transfer engine's payload carries, so the body tells the two apart (a second
route name would break neither kind of client, but vLLM's clients know only this one). A folder outside the
server's ``weights_dirs`` is refused (403), so a client cannot make the server read any path; a chunk is read only
from this user's private weights folders of /dev/shm. ``/pause?mode=keep`` holds the requests in flight across
the update (``OptimalSamplingDual.pause``): they go on under θ's new weights, their KV caches recomputed, and each
such sample names the θ version of every token (``theta_versions``). A
label theta's weights carried before is refused by the labelling routes (400): records and ``best_of`` tell
weights apart by their labels.
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
    from dual_sampling.server.protocol import (
        FinishWeightUpdateRequest,
        InitWeightTransferRequest,
        StartWeightUpdateRequest,
        UpdateWeightsRequest,
        UpdateWeightVersionRequest,
        WeightChunkRequest,
    )

    def sync() -> Any:  # θ's weight-sync client (asked for per call: one per model, kept by the dual engine)
        return dual.weight_sync("theta")

    async def answer(work: Callable[[], Awaitable[dict[str, Any]]], field: str | None = "update_info") -> JSONResponse:
        try:
            return JSONResponse(await work())
        except BadRequest as exc:
            return error_response(exc)
        except ValidationError as exc:
            return error_response(invalid_field(exc))
        except SyncError as exc:
            return error_response(BadRequest(str(exc), None, 503, "service_unavailable"))
        except ValueError as exc:  # the weights themselves: a tensor missing, extra, misshapen or not finite
            return error_response(BadRequest(str(exc), field))

    async def body(request: Request, model: type) -> Any:
        raw = await read_body(request)
        return model.model_validate(parse_body(raw) if raw.strip() else {})

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        async def work():
            try:
                await dual.pause_async(mode)
            except ValueError as exc:  # the mode's name or its use here: pause changes nothing then
                raise BadRequest(str(exc), "mode") from exc
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

    def check_label(version: str | None, field: str) -> None:
        if version is not None:
            # update_theta takes any label (the caller's to keep unique); a client may not reuse one.
            try:
                dual.driver.versions.check_new("theta", version)
            except ValueError as exc:
                raise BadRequest(str(exc), field) from exc

    @app.post("/update_weights")
    async def update_weights(request: Request):
        async def work():
            raw = parse_body(await read_body(request))
            info = raw.get("update_info") if isinstance(raw, dict) else None
            if info == {}:
                raise BadRequest(
                    "update_info names neither weights_path (a folder) nor a chunk (path, names, dtype_names, shapes, "
                    "offsets)",
                    "update_info",
                )
            if not (isinstance(info, dict) and "weights_path" in info):
                chunk = WeightChunkRequest.model_validate(raw)
                await asyncio.to_thread(sync().update_weights, chunk.update_info)
                return {"message": "Weights updated"}
            req = UpdateWeightsRequest.model_validate(raw)
            path = allowed_weights_path(req.update_info.weights_path, options.weights_dirs)
            async with labelling:
                check_label(req.weight_version, "weight_version")
                try:
                    version = await dual.update_theta_async(
                        path, version=req.weight_version, mode=req.mode, follow_symlinks=False
                    )
                except ValueError as exc:
                    raise BadRequest(str(exc), "update_info.weights_path") from exc
            return {"message": "Weights updated", "weight_version": version}

        return await answer(work, "update_info")

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        async def work():
            req = await body(request, InitWeightTransferRequest)
            sync().init_weight_transfer_engine(req.init_info)
            return {"message": "Weight transfer initialized"}

        return await answer(work, "init_info")

    async def start(request: Request, draft: bool) -> JSONResponse:
        async def work():
            await body(request, StartWeightUpdateRequest)
            if draft and not sync().draft:
                raise BadRequest("theta has an engine of its own here, not a draft model: use /start_weight_update")
            await asyncio.to_thread(sync().start_weight_update)
            return {"message": "Draft weight update started" if draft else "Weight update started"}

        return await answer(work, None)

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request):
        return await start(request, draft=False)

    @app.post("/start_draft_weight_update")
    async def start_draft_weight_update(request: Request):
        return await start(request, draft=True)

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        async def work():
            req = await body(request, FinishWeightUpdateRequest)
            async with labelling:
                check_label(req.weight_version, "weight_version")
                version = await asyncio.to_thread(sync().finish_weight_update, req.weight_version)
            return {"message": "Weight update finished", "weight_version": version}

        return await answer(work, None)

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        async def work():
            await asyncio.to_thread(sync().shutdown_weight_transfer_engine)
            return {"message": "Weight transfer shut down"}

        return await answer(work, None)

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        # The processes a trainer sends θ's weights to: θ's engine runs one worker (tensor, pipeline and data
        # parallel sizes 1, checked at start).
        return JSONResponse({"world_size": 1})

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
