"""The OpenAI-compatible HTTP server: FastAPI routes over one engine, either an `EngineClient` (the
engine in its own process, `engine_process.py`: how `serve` runs) or an in-process `Engine` (the
single-process server, `serve --single-process`, kept for comparison). Both take `add_request`,
`abort`, `grammar.compile_async` and `chat_prompt`; the engine's state comes as a snapshot
(`metrics.engine_snapshot`).

Routes, one module per group, each adding its routes to the app over the app's one `Service`
(`service.py`: the engine, the pending-request count, the metrics, and the steps the routes share):
``POST /v1/chat/completions`` (`chat_routes.py`), ``POST /v1/responses`` (the Responses API over the
chat route's steps: `responses_routes.py`, its protocol conversion in `responses.py`),
``POST /v1/completions`` (`completions_routes.py`), ``GET /health``, ``GET /metrics``,
``GET /v1/models`` (`info_routes.py`). This module builds the app: the service, the routes, the
lifespan, the error handlers and the gate (`gate.py`). See docs/api.md for the protocol and its
extensions.

Request life: read and size-check the body, validate it (pydantic), resolve the model, build the
grammar and compile it in a worker thread (a bad schema is a 400 before anything is queued), build
the prompt and sampling parameters, admit the request (503 + Retry-After past the limit), queue it on
the engine, then answer in one piece or stream it as server-sent events. If the client goes away,
the request is aborted and its KV slots return to the pool.
"""
from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from .chat_routes import add_chat_routes
from .completions_routes import add_completions_routes
from .engine_client import EngineUnavailable
from .errors import APIError, validation_error_to_api
from .gate import Gate
from .info_routes import add_info_routes
from .json_io import parse
from .protocol import ChatCompletionRequest
from .responses_routes import add_responses_routes
from .service import ClientGone, Service

log = logging.getLogger("constrained_spec.server")

API_KEY_ENV = "CONSTRAINED_SPEC_API_KEY"


@dataclass
class ServerConfig:
    """Server-side settings (the engine has its own EngineConfig)."""
    api_key: str | None = None  # None: no authentication; else /v1/* needs `Authorization: Bearer <key>`
    served_model_name: str | None = None  # the model id clients use; default: the engine's model name
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    # admitted generation requests (n counts n), the server's: each front-end admits its share;
    # None: the engine's running + queued
    max_pending_requests: int | None = None
    retry_after_s: int = 1  # Retry-After on 503
    default_max_tokens: int | None = None  # chat requests without max_tokens; None: up to the context limit
    frontends: int = 1  # front-end processes over the engine: each admits its share of the pending limit
    frontend: int = 0  # this one's number (0: the `serve` process); /health says it
    response_store: str | None = None  # a SQLite file the stored Responses persist in; None: memory only
    # origins a browser may call from (CORS); empty: none. "*" as OpenAI's API and vLLM answer: a web
    # page could call a server without --api-key anyway, through a page's own backend
    allowed_origins: tuple = ("*",)


def create_app(engine, config: ServerConfig | None = None, *, owns_engine: bool = False) -> FastAPI:
    """Builds the FastAPI app over `engine`. With `owns_engine`, app shutdown shuts the engine down."""
    config = config or ServerConfig()
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config.api_key = os.environ[API_KEY_ENV]
    service = Service(engine, config)
    metrics = service.metrics

    @asynccontextmanager
    async def lifespan(app):
        metrics.attach()
        try:
            yield
        finally:
            metrics.detach()
            service.close()
            if owns_engine:
                try:
                    await run_in_threadpool(engine.shutdown)
                except Exception:
                    log.exception("engine shutdown failed")

    # redirect_slashes off: a POST to `/v1/chat/completions/` was a 307 to an absolute http:// URL
    # (wrong behind a TLS proxy, not followed by httpx): a 404 in the error shape instead
    app = FastAPI(title="constrained-spec", version=_version(), lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible structured-output serving (grammar-constrained + speculative "
                              "decoding). See docs/api.md.")
    app.state.engine = engine
    app.state.server_config = config
    app.state.metrics = metrics
    app.state.server_state = service.state
    app.state.end_requests = service.end_requests  # at the shutdown drain's deadline (`runner.Server`)
    _add_error_handlers(app, service)
    # on the app itself, not as included APIRouters (FastAPI matches an included router's routes in a
    # second pass, ~10 us a request), and in this order: paths match in the order they were added
    for add_routes in (add_info_routes, add_chat_routes, add_responses_routes, add_completions_routes):
        add_routes(app, service)
    app.add_middleware(Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)
    if config.allowed_origins:  # outside the gate: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    _warm_up(engine, service.served)
    return app


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    """Every error answers in OpenAI's error shape (`errors.APIError`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # (Starlette's headers kept: a 405's `Allow`, which RFC 9110 requires)
        return APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _bad_parameters(request: Request, exc: RequestValidationError):
        # a query or path parameter of the wrong type (`?limit=abc`): FastAPI's own 422 shape otherwise
        return validation_error_to_api([{**e, "loc": [x for x in e.get("loc", ()) if x not in ("query", "path")]}
                                        for e in exc.errors()]).response()

    @app.exception_handler(EngineUnavailable)
    async def _engine_unavailable(request: Request, exc: EngineUnavailable):
        return service.unavailable().response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        # the client left before its body arrived: nobody to answer, nothing the server did wrong
        log.debug("client disconnected while sending %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        # the client left while its request waited (its grammar's compile, its first update): nobody to answer
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; see the server log", code="internal_error").response()


def _warm_up(engine, served: str) -> None:
    """What every request runs, once before the server takes any: parsing a request, the chat template,
    tokenizing and detokenizing. Their imports and caches start on first use, and in a fresh process
    that has no bytecode caches (a spawned front-end on a bare machine) they took seconds, which
    landed on the first requests each front-end served."""
    parse(ChatCompletionRequest, {"model": served, "messages": [{"role": "user", "content": "warm-up"}],
                                  "response_format": {"type": "json_object"}, "stream": True})
    from ..engine.detokenizer import IncrementalDetokenizer
    ids = engine.chat_prompt([{"role": "user", "content": "warm-up"}])
    IncrementalDetokenizer(engine.tokenizer, ids[:-2], []).add(ids[-2:])


def _version() -> str:
    try:
        from .. import __version__
        return __version__
    except Exception:
        return "0"
