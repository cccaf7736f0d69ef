"""GET /health (the process answers), /ready (it can serve: scheduler, store and a worker up), /metrics."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.gateway.state import GatewayState


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    checks = state.readiness()
    ok = all(checks.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    await state.refresh_tiers()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
