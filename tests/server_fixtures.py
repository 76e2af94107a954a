"""Session-wide fixtures for the server, client and CLI tests: the real SmolLM2 (CPU) in one engine
process behind real uvicorn servers on free localhost ports, each server a front-end with its own
connection to that process (as `serve` runs it); and the single-process server (`single_server`,
an in-process Engine) that `serve --single-process` keeps for comparison.

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


_SERVERS = ("server", "secured", "busy", "single")


def _shutdown_all() -> None:
    for key in _SERVERS:
        handle = _cache.pop(key, None)
        if handle is not None:
            handle.stop()
            if key != "single":  # (the in-process engine is shut down below)
                handle.engine.shutdown()
    for key in ("engine", "engine_process"):
        eng = _cache.pop(key, None)
        if eng is not None:
            try:
                eng.shutdown() if key == "engine" else eng.stop()
            except Exception:
                pass


def _engine_config(request):
    from constrained_spec.engine import EngineConfig
    # the server tests check answers of requests batched with whatever else runs
    return EngineConfig(model=_get_model_path(request), device="cpu", dtype=exact_dtype(), max_running_requests=64)


def _get_model_path(request) -> str:
    if "model_path" not in _cache:
        _cache["model_path"] = _model_path(request)
    return _cache["model_path"]


def _get_engine(request):
    """The in-process engine (the single-process server's)."""
    with _lock:
        if "engine" not in _cache:
            from constrained_spec.engine import Engine
            _cache["engine"] = Engine(_engine_config(request))
            request.session.config.add_cleanup(_shutdown_all)
        return _cache["engine"]


def _get_engine_process(request):
    """The engine process every split test server connects to."""
    with _lock:
        if "engine_process" not in _cache:
            from constrained_spec.server.engine_process import EngineProcess
            _cache["engine_process"] = EngineProcess(_engine_config(request))
            request.session.config.add_cleanup(_shutdown_all)
        return _cache["engine_process"]


class RunningServer:
    """A uvicorn server in a thread of the test process over `engine` (an EngineClient or Engine)."""

    def __init__(self, handle, engine):
        self.handle, self.engine = handle, engine
        self.url = handle.url

    def stop(self) -> None:
        self.handle.stop()


def _get_server(request, key: str, **server_kw):
    process = None if key == "single" else _get_engine_process(request)
    engine = _get_engine(request) if key == "single" else None
    with _lock:
        if key not in _cache:
            engine = engine or process.connect()
            from constrained_spec.server.app import ServerConfig, create_app
            from constrained_spec.server.runner import start_server_thread
            app = create_app(engine, ServerConfig(served_model_name=MODEL_ID, **server_kw))
            _cache[key] = RunningServer(start_server_thread(app, log_level="warning"), engine)
        return _cache[key]


@pytest.fixture(scope="session")
def server_model_path(request) -> str:
    return _get_model_path(request)


@pytest.fixture(scope="session")
def server_engine(request):
    """The real engine in this process (the single-process server's)."""
    return _get_engine(request)


@pytest.fixture(scope="session")
def engine_info(request):
    """The engine process's EngineInfo: its tokenizer, context, KV capacity."""
    return _get_engine_process(request).info


@pytest.fixture(scope="session")
def server(request):
    """The main server (a front-end over the engine process): no API key, default limits.
    `.url` is http://127.0.0.1:<port>."""
    return _get_server(request, "server")


@pytest.fixture(scope="session")
def secured_server(request):
    """Another front-end of the same engine process; needs `Authorization: Bearer API_KEY`; 4 KiB body limit."""
    return _get_server(request, "secured", api_key=API_KEY, max_body_bytes=4096)


@pytest.fixture(scope="session")
def busy_server(request):
    """Another front-end of the same engine process; admits at most 1 pending generation request (the 503 test)."""
    return _get_server(request, "busy", max_pending_requests=1, retry_after_s=2)


@pytest.fixture(scope="session")
def single_server(request):
    """The single-process server (`serve --single-process`): the in-process engine under the app."""
    return _get_server(request, "single")


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


def engine_state(server) -> dict:
    """The engine's state as the server's /health reports it (KV slots, running and waiting requests)."""
    return httpx.get(server.url + "/health", timeout=30).json()


def break_off(stream, server, after: int) -> None:
    """Reads `after` events of an `openai` stream, closes it mid-answer, then waits for the server
    to have aborted the request (its KV back in the pool)."""
    for i, _ in enumerate(stream):
        if i >= after:
            break
    stream.close()
    wait_kv_full(server, timeout=10)


def give_up_on(server, path: str, body: dict) -> None:
    """Posts a long request and closes the connection after 1.5 s without an answer, then waits for
    the server to have aborted it (its KV back in the pool)."""
    with httpx.Client(base_url=server.url, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(path, json=body)
    wait_kv_full(server, timeout=10)


def wait_kv_full(server, timeout: float = 15.0) -> None:
    """Waits until every KV slot of the server's engine is free and nothing runs (fails the test
    after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        h = engine_state(server)
        if h["kv_free_slots"] == h["kv_capacity"] and not h["requests_running"] and not h["requests_waiting"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool not full again: {h}")
        time.sleep(0.05)


def chat_body(content: str = "Say hello.", **kw) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    body.update(kw)
    return body


__all__ = ["MODEL_ID", "API_KEY", "server_model_path", "server_engine", "engine_info", "server", "secured_server",
           "busy_server", "single_server", "http", "openai_client", "wait_kv_full", "engine_state", "chat_body"]
