"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    from constrained_spec.server import create_app, ServerConfig, run_server

Importing this package is light; the app module (FastAPI, the engine) loads on first use.
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("create_app", "ServerConfig", "API_KEY_ENV"):
        from . import app
        return getattr(app, name)
    if name in ("run_server", "ServerHandle", "start_server_thread"):
        from . import runner
        return getattr(runner, name)
    raise AttributeError(name)


__all__ = ["create_app", "ServerConfig", "run_server", "start_server_thread", "ServerHandle", "API_KEY_ENV"]
