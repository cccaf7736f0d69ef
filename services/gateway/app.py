"""The gateway's Starlette application: routes of the public HTTP contract."""
from __future__ import annotations

import contextlib
import time

from starlette.applications import Starlette
from starlette.routing import Route

from services.gateway import adapters, dashboard, inference, openapi, ops, status
from services.gateway.config import GatewayConfig
from services.gateway.errors import exception_handlers
from services.gateway.state import GatewayState

ROUTES = [
    Route("/v1/completions", inference.completions, methods=["POST"]),
    Route("/v1/chat/completions", inference.chat_completions, methods=["POST"]),
    Route("/v1/models", adapters.list_models, methods=["GET"]),
    Route("/v1/adapters", adapters.register, methods=["POST"]),
    Route("/v1/adapters", adapters.list_adapters, methods=["GET"]),
    Route("/v1/adapters/{name}", adapters.get_adapter, methods=["GET"]),
    Route("/v1/adapters/{name}", adapters.delete_adapter, methods=["DELETE"]),
    Route("/v1/load_lora_adapter", adapters.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", adapters.unload_lora_adapter, methods=["POST"]),
    Route("/health", ops.health, methods=["GET"]),
    Route("/ready", ops.ready, methods=["GET"]),
    Route("/metrics", ops.metrics, methods=["GET"]),
    Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
    Route("/v1/status", status.status, methods=["GET"]),
    Route("/dashboard", dashboard.dashboard_page, methods=["GET"]),
    Route("/dashboard/adapters", dashboard.adapters_page, methods=["GET"]),
    Route("/static/{name}", dashboard.asset, methods=["GET"]),
]


def build_app(config: GatewayConfig, state: GatewayState | None = None) -> Starlette:
    state = state or GatewayState(config)
    sampler = status.StatusSampler(state)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        sampler.start()
        try:
            yield
        finally:
            await sampler.close()
            await state.close()

    app = Starlette(routes=ROUTES, lifespan=lifespan,
                    exception_handlers=exception_handlers(lambda request: request.app.state.gateway.log))
    app.state.gateway = state
    app.state.status_sampler = sampler
    app.state.started_at = time.monotonic()
    return app
