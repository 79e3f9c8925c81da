"""``/health`` and ``/metrics`` (Prometheus text, vLLM-like names)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fp4moe.engine.loop.core import EngineStoppedError
from fp4moe.server.errors import APIError
from fp4moe.server.responses import HealthStatus
from fp4moe.server.serving import serving

router = APIRouter()


@router.get(
    "/health",
    response_model=HealthStatus,
    responses={503: {"model": HealthStatus, "description": "The engine thread is not running."}},
)
async def health(request: Request):
    srv = serving(request)
    if srv.engine.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine stopped"}, status_code=503)


@router.get("/metrics")
async def prometheus(request: Request):
    srv = serving(request)
    try:
        snap = await srv.engine.snapshot()
    except EngineStoppedError as e:
        raise APIError(503, str(e), "service_unavailable") from None
    return Response(srv.metrics.render(snap), media_type="text/plain; version=0.0.4")
