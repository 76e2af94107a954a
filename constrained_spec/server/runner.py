"""Running the app under uvicorn: in the foreground (the CLI) or in a background thread (tests,
notebooks, embedding)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import uvicorn

from .. import long_lived

log = logging.getLogger("constrained_spec.server")

DRAIN_S = 5  # at shutdown, requests in flight have this long to finish (uvicorn's timeout_graceful_shutdown)
END_BEFORE_S = 0.5  # the app ends the requests still going this long before uvicorn would cancel them


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                          timeout_graceful_shutdown=DRAIN_S, timeout_keep_alive=30, lifespan="on", log_config=None)


class Server(uvicorn.Server):
    """uvicorn's server, with the drain's end the app's own: at `timeout_graceful_shutdown` uvicorn
    cancels the requests still running, which answered a plain-text 500 (and logged an ASGI
    traceback) or cut a stream with no end. `END_BEFORE_S` earlier, the app's
    `app.state.end_requests()` ends them itself: a JSON 503 `server_shutting_down`, or a stream's
    error event and its end (`Service.end_requests`). A second Ctrl-C ends them at once.

    `handle_signals=False`: no signal handlers (a front-end process, which ignores the signals sent
    to the whole process group and stops when its parent says so). `on_shutdown(force)`: called
    when the drain begins (force False), and on a second Ctrl-C (force True)."""

    def __init__(self, config: uvicorn.Config, handle_signals: bool = True,
                 on_shutdown: Callable[[bool], None] | None = None):
        super().__init__(config)
        self._handle_signals = handle_signals
        self._on_shutdown = on_shutdown
        self._end_requests_now: Callable[[], None] | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if not self._handle_signals:
            yield
            return
        with super().capture_signals():
            yield

    def handle_exit(self, sig, frame) -> None:
        forced = self.force_exit
        super().handle_exit(sig, frame)
        if self.force_exit and not forced:  # a second Ctrl-C: stop at once
            if self._end_requests_now is not None:
                self._end_requests_now()
            self._shutdown_hook(True)

    def _shutdown_hook(self, force: bool) -> None:
        if self._on_shutdown is not None:
            try:
                self._on_shutdown(force)
            except Exception:
                log.exception("shutdown hook failed")

    def force(self) -> None:
        """As a second Ctrl-C: the requests still going end now, and the server stops at once."""
        if not self.force_exit:
            self.should_exit = self.force_exit = True
            if self._end_requests_now is not None:
                self._end_requests_now()

    async def shutdown(self, sockets=None) -> None:
        self._shutdown_hook(self.force_exit)
        end = getattr(getattr(self.config.app, "state", None), "end_requests", None)
        timer = None
        if end is not None:
            loop = asyncio.get_running_loop()
            # (a signal handler, or another thread: onto the loop)
            self._end_requests_now = lambda: loop.call_soon_threadsafe(end)
            drain_s = self.config.timeout_graceful_shutdown
            if self.force_exit:
                end()
            elif drain_s is not None:  # (None: uvicorn waits for them for ever)
                timer = loop.call_later(max(0.0, drain_s - END_BEFORE_S), end)
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                deadline = time.monotonic() + 0.5  # a moment for the requests just ended to answer
                while self.server_state.tasks and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                # which uvicorn skips when forced: the app's shutdown (its engine connection closed,
                # an engine it owns stopped), rather than the lifespan task cancelled (a traceback)
                await self.lifespan.shutdown()
        finally:
            if timer is not None:
                timer.cancel()


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", sock=None,
               on_shutdown: Callable[[bool], None] | None = None) -> None:
    """Serves `app` in the foreground until Ctrl-C / SIGTERM (on `sock`, a bound socket, if given).
    `on_shutdown(force)`: see `Server`."""
    long_lived.freeze()  # the app (and an in-process engine): for the process's life
    Server(uvicorn_config(app, host, port, log_level), on_shutdown=on_shutdown).run(
        sockets=None if sock is None else [sock])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server_thread(app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                        ready_timeout: float = 30.0) -> ServerHandle:
    """Starts uvicorn in a daemon thread on `port` (a free one by default) and waits until it listens."""
    port = port or free_port(host)
    server = Server(uvicorn_config(app, host, port, log_level))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn on {host}:{port} exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn on {host}:{port} did not start within {ready_timeout}s")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port)


def wait_for_frontends(url: str, timeout_s: float = 300.0) -> int:
    """Waits until every front-end process of the `serve` at `url` serves, and returns how many there
    are. Front-end 0 serves first and the others join as they start, each taking connections only
    once it serves: /health on fresh connections, until each front-end's number has answered.
    A benchmark waits for this so that it measures the whole server."""
    import httpx
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = httpx.get(url + "/health", timeout=5).json()
            seen.add(int(health.get("frontend", 0)))
            if len(seen) >= int(health.get("frontends", 1)):
                return len(seen)
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"front-ends {sorted(seen)} of the server at {url} serve after {timeout_s:.0f} s")
        time.sleep(0.05)
