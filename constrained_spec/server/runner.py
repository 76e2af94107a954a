"""Running the app under uvicorn: in the foreground (the CLI) or in a background thread (tests,
notebooks, embedding)."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from .. import long_lived


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                          timeout_graceful_shutdown=5, timeout_keep_alive=30, lifespan="on", log_config=None)


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", sock=None) -> None:
    """Serves `app` in the foreground until Ctrl-C / SIGTERM (on `sock`, a bound socket, if given)."""
    long_lived.freeze()  # the app (and an in-process engine): for the process's life
    uvicorn.Server(uvicorn_config(app, host, port, log_level)).run(sockets=None if sock is None else [sock])


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
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
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
