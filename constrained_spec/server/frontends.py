"""Several HTTP front-end processes over one engine process (`serve --frontends N`).

A front-end's work is per request (HTTP parsing, validation, the chat template, tokenizing,
answers and SSE events) and grows with the clients, while the engine's is per step. One Python
process does that work for every client on one core; from ~100 concurrent clients, or streamed
answers at tens of thousands of events a second, it is the server's limit. So the `serve` process
binds the listening socket and runs front-end 0 itself, and N-1 more processes (spawned) serve the
same port. On Linux each binds a socket of its own with SO_REUSEPORT, and the kernel spreads new
connections evenly over them: with one shared socket, whichever process woke first took a burst of
them (64 clients connecting at once came out as 49/8/6/1 over four front-ends, so one front-end did
most of the work). Elsewhere they share the `serve` process's socket. Each front-end is one
`EngineClient` connection to the engine process, whose requests are its own.

Lifecycles: a front-end lives as long as the pipe from the `serve` process; when that closes or
says "stop", it stops serving (uvicorn's drain, then its connection closes and the engine aborts
what it had in flight; "force": at once). It ignores SIGINT and SIGTERM (`children.py`): Ctrl-C
reaches the whole process group, and the `serve` process tells each front-end to stop as its own
drain begins, so that they drain together.
A front-end that dies is restarted in its place; its clients' requests fail, no other's do. (With
SO_REUSEPORT the connections the kernel had queued on its socket, not yet accepted, are reset with
it; Linux's `net.ipv4.tcp_migrate_req=1` hands them to the other front-ends instead.)

Metrics: prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set before any
front-end imports prometheus_client), so /metrics from any front-end counts every front-end's
requests.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from .. import long_lived
from . import children
from ..cpus import available_cores, name_os_thread
from ..log_setup import setup_logging

log = logging.getLogger("constrained_spec.frontends")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def default_frontends() -> int:
    """One front-end per four cores, 1 to 4: the engine process and its helper threads keep the rest."""
    return max(1, min(4, available_cores() // 4))


# one listening socket per front-end, balanced by the kernel (see above)
BALANCED = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def bind_socket(host: str, port: int, join: bool = False) -> socket.socket:
    """A front-end's socket (IPv6 when the host is an IPv6 address). Where BALANCED, every front-end
    binds one on the same port; elsewhere the `serve` process's is shared. `serve`'s own (not
    `join`) listens at once: it first binds the port plainly, so that a port another server holds,
    even with SO_REUSEPORT, is an error rather than shared with it, and its listening socket keeps
    the port from being taken while the other front-ends start. A joining front-end's is bound but
    not listening, and uvicorn makes it listen once it serves: the kernel hands connections only to
    listening sockets, so none waits on a front-end that is still starting, or starting again (one
    that listened from its start held its share of the new connections while its app was built)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if join and BALANCED:
        return _bound_reuse_port(family, host, port)
    if BALANCED:
        with socket.create_server((host, port), family=family) as probe:  # EADDRINUSE if taken
            port = probe.getsockname()[1]  # (port 0: the one the kernel picked)
    sock = socket.create_server((host, port), family=family, backlog=2048, reuse_port=BALANCED)
    sock.set_inheritable(not BALANCED)
    return sock


def _bound_reuse_port(family: int, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def use_shared_metrics() -> str:
    """Makes /metrics count every front-end: a fresh directory for prometheus_client's multiprocess
    files, in the environment the front-ends inherit. Call before prometheus_client is imported."""
    path = tempfile.mkdtemp(prefix="constrained-spec-metrics-")
    os.environ[METRICS_DIR_ENV] = path
    return path


def _frontend_main(number: int, info, server_config, listen, log_level: str, lifeline) -> None:
    """A front-end process: one connection to the engine, the app, uvicorn on its socket (`listen`:
    the shared socket, or the (host, port) to bind its own on)."""
    children.ignore_stop_signals()  # first: a signal to the process group is the parent's to handle
    setup_logging(log_level)
    name_os_thread("cs-frontend")
    from .app import create_app
    from .engine_client import EngineClient
    from .runner import Server, uvicorn_config

    try:
        client = EngineClient(info)
    except OSError as e:
        log.error("front-end %d cannot reach the engine process: %s", number, e)
        raise SystemExit(1)
    server_config = dataclasses.replace(server_config, frontend=number)
    app = create_app(client, server_config, owns_engine=True)  # owns its connection, not the engine process
    server = Server(uvicorn_config(app, log_level=log_level), handle_signals=False)
    sock = bind_socket(*listen, join=True) if isinstance(listen, tuple) else listen  # listens in server.run
    lifeline.send("ready")

    def watch_lifeline() -> None:
        try:
            while lifeline.recv() != "force":  # "stop": drain; "force": stop at once
                server.should_exit = True
            server.force()
        except (EOFError, OSError):  # the serve process is gone
            server.should_exit = True
    threading.Thread(target=watch_lifeline, name="frontend-lifeline", daemon=True).start()
    log.info("front-end %d serving (pid %d)", number, os.getpid())
    long_lived.freeze()  # the app, its routes and tokenizer: for the process's life
    server.run(sockets=[sock])


class FrontendProcesses:
    """Front-ends 1..N-1 (the serve process is front-end 0, on `sock`), restarted if one dies.
    Started, not awaited: front-end 0 serves at once, and each other one takes connections from
    when it serves (its socket listens only then). Front-end 0 waiting for them all before serving
    held the connections the kernel handed its listening socket meanwhile: on the H100 host, with
    four front-ends, a request right after a /health that another front-end answered waited ~10 s."""

    def __init__(self, count: int, info, server_config, sock: socket.socket, log_level: str,
                 ready_timeout_s: float = 120.0):
        self._ctx = mp.get_context("spawn")
        listen = sock.getsockname()[:2] if BALANCED else sock  # the bound port, also when 0 was asked
        self._args = (info, server_config, listen, log_level)
        self._procs: dict[int, tuple] = {}
        self._stopping = threading.Event()
        for number in range(1, count):
            self._start(number)
        self._watcher = threading.Thread(target=self._watch, args=(ready_timeout_s,), name="frontend-watcher",
                                         daemon=True)
        self._watcher.start()

    def _start(self, number: int) -> None:
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=_frontend_main, args=(number, *self._args, theirs),
                                 name=f"constrained-spec-frontend-{number}", daemon=True)
        children.start(proc)
        theirs.close()
        self._procs[number] = (proc, ours)

    @staticmethod
    def _await_ready(proc, pipe, deadline: float) -> bool:
        try:
            while time.monotonic() < deadline and proc.is_alive():
                if pipe.poll(0.1):
                    return pipe.recv() == "ready"
        except (EOFError, OSError, ValueError):  # the process died, or `stop` closed the pipe
            pass
        return False

    def _watch(self, ready_timeout_s: float) -> None:
        deadline = time.monotonic() + ready_timeout_s
        for number, (proc, pipe) in list(self._procs.items()):  # started together, awaited in turn
            if not self._await_ready(proc, pipe, deadline) and not self._stopping.is_set():
                log.error("front-end %d did not start (code %s); serving without it", number, proc.exitcode)
        while not self._stopping.wait(1.0):
            for number, (proc, pipe) in list(self._procs.items()):
                if not proc.is_alive() and not self._stopping.is_set():
                    log.error("front-end %d exited (code %s); starting it again", number, proc.exitcode)
                    _forget_metrics_of(proc.pid)
                    pipe.close()
                    self._start(number)
                    self._stopping.wait(5.0)  # at most one restart in 5 s, whatever goes on failing

    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self._procs.values()]

    def begin_stop(self, force: bool = False) -> None:
        """Asks every front-end to finish: uvicorn's drain, as the `serve` process's own begins (so
        all drain together, none taking new connections meanwhile), or with `force`, at once. None
        is started again from now on."""
        self._stopping.set()
        for proc, pipe in list(self._procs.values()):
            try:
                pipe.send("force" if force else "stop")
            except (OSError, ValueError):
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Asks every front-end to finish (if `begin_stop` did not already), then makes sure."""
        if not self._stopping.is_set():
            self.begin_stop()
        deadline = time.monotonic() + timeout_s
        for proc, pipe in self._procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            _forget_metrics_of(proc.pid)
            pipe.close()
        self._procs.clear()


def _forget_metrics_of(pid: int) -> None:
    """A dead front-end's live gauges (requests in flight) stop counting."""
    if os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid)


def remove_metrics_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
