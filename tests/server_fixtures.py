"""Session-wide fixtures for the server, client and CLI tests: one real Engine on the real SmolLM2
(CPU) behind real uvicorn servers on free localhost ports.

Test modules import these names (`from server_fixtures import *`). pytest treats a fixture imported
into two modules as two fixtures, so the objects themselves are cached here at module level: the
engine loads once per session, and each server variant starts once.
"""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

MODEL_ID = "smollm2"  # the name the test servers serve the model under
API_KEY = "test-secret-key"

_lock = threading.Lock()
_cache: dict[str, object] = {}


def _model_path(request) -> str:
    """`smollm2_dir` from tests/conftest.py when it exists; else the default model (fetched/cached)."""
    try:
        return str(request.getfixturevalue("smollm2_dir"))
    except pytest.FixtureLookupError:
        from constrained_spec.models import resolve_model_path
        return resolve_model_path(None)


def exact_dtype() -> str:
    """The CPU dtype for tests that compare answers token for token (batch invariance, top_k=1
    against greedy): bfloat16 keeps them exact only through our AMX kernels (float32 logits);
    without AMX, oneDNN's bfloat16 GEMMs depend on the batch and write bfloat16 logits that tie."""
    from constrained_spec.kernels import cpu_native
    return "auto" if cpu_native.amx_linear_available() else "float32"


def _shutdown_all() -> None:
    for key in ("server", "secured", "tiny", "busy"):
        handle = _cache.pop(key, None)
        if handle is not None:
            handle.stop()
    eng = _cache.pop("engine", None)
    if eng is not None:
        try:
            eng.shutdown()
        except Exception:
            pass


def _get_engine(request):
    with _lock:
        if "engine" not in _cache:
            from constrained_spec.engine import Engine, EngineConfig
            _cache["model_path"] = _model_path(request)
            # the server tests check answers of requests batched with whatever else runs
            _cache["engine"] = Engine(EngineConfig(model=_cache["model_path"], device="cpu", dtype=exact_dtype(),
                                                   max_running_requests=64))
            request.session.config.add_cleanup(_shutdown_all)
        return _cache["engine"]


def _get_server(request, key: str, **server_kw):
    engine = _get_engine(request)
    with _lock:
        if key not in _cache:
            from constrained_spec.server.app import ServerConfig, create_app
            from constrained_spec.server.runner import start_server_thread
            app = create_app(engine, ServerConfig(served_model_name=MODEL_ID, **server_kw))
            _cache[key] = start_server_thread(app, log_level="warning")
        return _cache[key]


@pytest.fixture(scope="session")
def server_model_path(request) -> str:
    _get_engine(request)
    return _cache["model_path"]


@pytest.fixture(scope="session")
def server_engine(request):
    """The real engine shared by every test server."""
    return _get_engine(request)


@pytest.fixture(scope="session")
def server(request):
    """The main server: no API key, default limits. `.url` is http://127.0.0.1:<port>."""
    return _get_server(request, "server")


@pytest.fixture(scope="session")
def secured_server(request):
    """Same engine; needs `Authorization: Bearer API_KEY`; 4 KiB body limit."""
    return _get_server(request, "secured", api_key=API_KEY, max_body_bytes=4096)


@pytest.fixture(scope="session")
def busy_server(request):
    """Same engine; admits at most 1 pending generation request (the 503 test)."""
    return _get_server(request, "busy", max_pending_requests=1, retry_after_s=2)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture()
def openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def wait_kv_full(engine, timeout: float = 15.0) -> None:
    """Waits until every KV slot is free and nothing runs (fails the test after `timeout`)."""
    pool = engine.runner.pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool.num_free == pool.capacity and not engine.scheduler.running and not engine.scheduler.waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"KV pool not full again: {pool.num_free}/{pool.capacity} free, "
                         f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting")


def chat_body(content: str = "Say hello.", **kw) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    body.update(kw)
    return body


__all__ = ["MODEL_ID", "API_KEY", "server_model_path", "server_engine", "server", "secured_server", "busy_server", "http",
           "openai_client", "wait_kv_full", "chat_body"]
