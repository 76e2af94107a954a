"""The routes that report on the server: ``GET /health``, ``GET /metrics``, ``GET /v1/models`` and
``GET /v1/models/{id}``."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.responses import Response

from .engine_client import EngineUnavailable
from .json_io import json_response
from .service import Service


# HEAD as GET (uptime monitors and probes use it; it was a 405), its body left out by the server
_GET_AND_HEAD = ["GET", "HEAD"]


def add_info_routes(app: FastAPI, service: Service) -> None:
    state, config, served = service.state, service.config, service.served

    async def snapshot_if_running() -> dict | None:
        try:
            return await service.snapshot() if service.healthy() else None
        except (EngineUnavailable, asyncio.TimeoutError):
            return None

    @app.api_route("/health", methods=_GET_AND_HEAD)
    async def health():
        snap = await snapshot_if_running()
        if snap is None:
            given_up = getattr(service.engine, "given_up", None)
            why = f"the engine is not running; {given_up}" if given_up else "the engine is not running"
            return json_response({"status": "unhealthy", "model": served, "error": why,
                                  "pending_requests": state.pending}, status=503)
        return json_response({"status": "ok", "model": served, "kv_free_slots": snap["kv_free"],
                              "kv_capacity": snap["kv_capacity"], "requests_running": snap["running"],
                              "requests_waiting": snap["waiting"], "pending_requests": state.pending,
                              "frontend": config.frontend, "frontends": config.frontends})

    @app.api_route("/metrics", methods=_GET_AND_HEAD)
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        snap = await snapshot_if_running()
        return Response(service.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=_GET_AND_HEAD)
    async def list_models():
        return json_response({"object": "list", "data": [service.model_card()]})

    @app.api_route("/v1/models/{model_id:path}", methods=_GET_AND_HEAD)
    async def get_model(model_id: str):
        service.check_model(model_id)
        return json_response(service.model_card())
