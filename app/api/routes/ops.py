"""GET /health and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.json_body import StrictJSONRoute
from app.api.state import State

router = APIRouter(route_class=StrictJSONRoute)


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
async def health(state: State) -> JSONResponse:
    """200 once the engine (and its worker) answered; 503 while it is starting, gone or draining."""
    if state.drain.started:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.engine.is_ready:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine not ready"}, status_code=503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_mm_cache")
async def reset_mm_cache(state: State) -> JSONResponse:
    """Empties the processor cache, the IPC mirror with this API's receiver-cache partition (one
    ordered message), and every freeable encoder-cache entry. Requests in flight are not affected."""
    state.chat.inputs.processor_cache.clear()
    state.engine.reset_caches()
    return JSONResponse({"status": "ok"})
