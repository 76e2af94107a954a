"""The engine process: the Engine (scheduler, model runner, grammar compiles and matchers, sampler)
alone in a process, serving front-end processes over Unix-socket connections (`ipc.py`).

Why a process: the HTTP work (parsing, JSON, SSE, the event loop) and the engine loop in one
process share one GIL, and from 64 clients up the server delivered a third to a half of what the
engine computes. Here the engine thread keeps its process's GIL to itself but for two helper
threads per connection that mostly wait in system calls: a reader that queues requests, and a
sender that pickles and writes each step's updates.

One message per engine step per connection: the requests' `on_output` callbacks append updates
(token ids only: the front-end detokenizes) to their connection's list, a streamed request's
next token goes to the connection's `step_tokens` list (no update object, no callback), and the
engine's `step_hook`, called once per loop iteration, hands both lists to that connection's sender.
A request its front-end answers in one piece runs with `each_step=False`: its first update and its
last, nothing between.

Lifecycles: a connection that closes (its front-end exited or restarted) aborts its own requests
only, so their KV slots return to the pool and other connections' requests go on. A request the
engine refuses, or a call that fails, is answered on its own. The process lives as long as the
pipe from the process that started it (`EngineProcess`): it stops when that pipe says "stop" or
closes (the parent died), so no engine is left holding a GPU. It ignores SIGINT and SIGTERM
(`children.py`): Ctrl-C and the like reach a whole process group, and the `serve` process stops
its engine itself, once its requests in flight have drained.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..cpus import name_os_thread
from ..engine.engine import EXIT_COMPILE_WAIT_S, refusal_kind
from . import children, ipc
from .response_store import ResponseStore

log = logging.getLogger("constrained_spec.engine_process")


@dataclass
class EngineInfo:
    """What a front-end needs to know of the engine: sent once when the engine is ready."""
    address: str  # the Unix socket front-ends connect to
    pid: int
    model_name: str
    tokenizer: Any  # the engine's own tokenizer, pickled: the front-end's is the same
    max_context: int
    kv_capacity: int
    max_running_requests: int
    max_queued_requests: int
    device: str
    dtype: str
    start_s: float = 0.0  # its start, spawn to ready: how long a client waits for it to come back


class _Connection:
    """One front-end: its requests, their pending updates, and its reader and sender threads."""

    def __init__(self, server: "EngineServer", sock: socket.socket, number: int):
        self.server = server
        self.engine = server.engine
        self.channel = ipc.Channel(sock)
        self.number = number
        self.live: dict[int, str] = {}  # key -> engine request id, until finished
        self.updates: list[tuple] = []  # this step's updates (engine thread)
        self.tokens: list[tuple] = []  # this step's streamed tokens: (key, token, logprob, n) (engine thread)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        # "compile" calls in flight: call id -> the compile's future (None until it is made); a
        # "cancel" for one cancels it, so the compile queue keeps no waiter for a client gone
        self.compiles: dict[int, Any] = {}
        self.compiles_lock = threading.Lock()
        threading.Thread(target=self._read_loop, name=f"engine-conn{number}-reader", daemon=True).start()
        threading.Thread(target=self._send_loop, name=f"engine-conn{number}-sender", daemon=True).start()

    # -- front-end -> engine ---------------------------------------------------------------------
    def _read_loop(self) -> None:
        name_os_thread("cs-conn-read")
        try:
            while True:
                msg = self.channel.recv()
                try:
                    self._dispatch(msg)
                except Exception:
                    log.exception("connection %d: message %r failed", self.number, msg[:2])
        except (EOFError, OSError):
            pass
        finally:
            self._close()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, key, request_id, prompt, params, grammar, whole = msg
            try:
                self.live[key] = request_id
                self.engine.add_request(prompt, params, grammar, self._callback(key), request_id=request_id,
                                        detokenize=False, each_step=not whole,
                                        step_tokens=None if whole else self.tokens, stream_key=key,
                                        announce=not whole)
            except Exception as e:  # refused (queue full, too long) or broken: this request alone fails
                self.live.pop(key, None)
                kind = refusal_kind(e)  # the engine's or the compile queue full (busy), or the grammar refused
                error = str(e) if kind is not None else f"{type(e).__name__}: {e}"
                self.outbox.put(("out", [], [(key, [], True, "error", error, None, 0, None, 0, kind)]))
        elif kind == "abort":
            request_id = self.live.get(msg[1])
            if request_id is not None:
                self.engine.abort(request_id)
        elif kind == "call":
            self._call(*msg[1:])
        elif kind == "cancel":
            self._cancel_compile(msg[1])
        else:
            log.error("connection %d: unknown message %r", self.number, kind)

    def _callback(self, key: int):
        def on_output(out) -> None:
            reason = out.finish_reason  # into this step's list (swapped each step: looked up now)
            self.updates.append((key, out.new_token_ids, out.finished, None if reason is None else reason.value,
                                 out.error, out.matched_stop, out.completion_tokens, out.logprobs,
                                 out.cached_tokens, out.error_kind))
            if out.finished:
                self.live.pop(key, None)
        return on_output

    def _call(self, call_id: int, name: str, arg) -> None:
        def reply(ok: bool, value) -> None:
            try:
                self.outbox.put(("reply", call_id, ok, value))
            except Exception:  # pragma: no cover - the queue takes anything
                log.exception("reply to call %s failed", name)

        try:
            if name == "compile":  # normalizing a schema may take a while: not on this reader thread
                with self.compiles_lock:
                    self.compiles[call_id] = None
                self.server.calls.submit(self._compile, call_id, arg, reply)
            elif name == "snapshot":
                from .metrics import engine_snapshot
                reply(True, {**engine_snapshot(self.engine), "stored_responses": self.server.responses.snapshot()})
            elif name == "info":  # a front-end reconnecting to an engine started again
                reply(True, replace(self.server.info, tokenizer=None))
            elif name == "responses":  # the stored Responses every front-end shares
                reply(True, self.server.responses.call(*arg))
            else:
                reply(False, ValueError(f"unknown call {name!r}"))
        except Exception as e:
            reply(False, e)

    def _compile(self, call_id: int, spec, reply) -> None:
        with self.compiles_lock:
            if call_id not in self.compiles:  # cancelled before it began
                return
        try:
            future = self.engine.grammar.compile_async(spec, check_only=True)
        except Exception as e:
            self._compile_done(call_id)
            reply(False, e)
            return
        with self.compiles_lock:
            cancelled = call_id not in self.compiles
            if not cancelled:
                self.compiles[call_id] = future
        if cancelled:  # while it was being submitted
            future.cancel()

        def done(f) -> None:
            self._compile_done(call_id)
            if f.cancelled():  # its caller gave up: nobody to answer
                return
            reply(True, None) if f.exception() is None else reply(False, f.exception())
        future.add_done_callback(done)

    def _compile_done(self, call_id: int) -> None:
        with self.compiles_lock:
            self.compiles.pop(call_id, None)

    def _cancel_compile(self, call_id: int) -> None:
        with self.compiles_lock:
            future = self.compiles.pop(call_id, None)
        if future is not None:
            future.cancel()

    # -- engine -> front-end ---------------------------------------------------------------------
    def flush(self) -> None:
        """The engine thread, once per step: this step's tokens and updates in one message (a
        request's tokens of a step come before its updates of the step)."""
        if self.updates or self.tokens:
            batch, self.updates = self.updates, []
            tokens = self.tokens.copy()  # the requests hold this list: emptied, not replaced
            self.tokens.clear()
            if not self.closed:
                self.outbox.put(("out", tokens, batch))

    def _send_loop(self) -> None:
        name_os_thread("cs-conn-send")
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                self.channel.send(msg)
            except (OSError, ValueError):
                self._close()
                return
            except Exception as e:  # an unpicklable value (an exception from a call): say so instead
                if msg[0] == "reply":
                    self.outbox.put(("reply", msg[1], False, RuntimeError(f"{type(e).__name__}: {e}")))
                else:
                    log.exception("connection %d: cannot send a step's updates", self.number)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.live.values()):  # the front-end is gone: free its requests' KV
            self.engine.abort(request_id)
        for call_id in list(self.compiles):  # and wait for no compile of its
            self._cancel_compile(call_id)
        self.outbox.put(None)
        self.channel.close()
        self.server.forget(self)
        log.info("front-end connection %d closed; %d of its requests aborted", self.number, len(self.live))


class EngineServer:
    """Accepts front-end connections on a Unix socket and ships each step's updates to them."""

    def __init__(self, engine, address: str, response_store: str | None = None):
        self.engine = engine
        self.address = address
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(64)
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._count = 0
        self.calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-calls")
        self.responses = ResponseStore(path=response_store)
        self.info: EngineInfo | None = None  # set once the engine is ready (`_main`)
        engine.step_hook = self._flush_all
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._count += 1
                conn = _Connection(self, sock, self._count)
                self._connections = self._connections + [conn]  # copy: the engine thread iterates it
            log.info("front-end connection %d opened", conn.number)

    def _flush_all(self) -> None:
        for conn in self._connections:
            conn.flush()

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections = [c for c in self._connections if c is not conn]

    def close(self) -> None:
        self.calls.shutdown(wait=False)
        self.responses.close()
        try:
            self._listener.close()
        finally:
            try:
                os.unlink(self.address)
            except OSError:
                pass


def _main(config, address: str, lifeline, response_store: str | None = None) -> None:
    """The engine process's body: build the engine, say ready (or why not), serve until told to stop
    or the parent is gone."""
    children.ignore_stop_signals()  # first: a signal to the process group is the parent's to handle
    started = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
                        datefmt="%H:%M:%S")
    name_os_thread("cs-engine-proc")  # the process's name in ps and top
    try:
        from ..engine import Engine
        engine = Engine(config)
        engine.grammar.warm_up()  # the first grammar request would otherwise pay it
        server = EngineServer(engine, address, response_store)
        runner = engine.runner
        server.info = EngineInfo(
            address=address, pid=os.getpid(), model_name=engine.model_name, tokenizer=engine.tokenizer,
            max_context=int(engine.max_context), kv_capacity=int(runner.pool.capacity),
            max_running_requests=engine.config.max_running_requests, max_queued_requests=engine.config.max_queued_requests,
            device=str(engine.device), dtype=str(getattr(runner, "dtype", "")).replace("torch.", ""),
            start_s=time.monotonic() - started)
        lifeline.send(("ready", server.info))
    except BaseException as e:
        import traceback
        lifeline.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    try:
        while True:
            try:
                if lifeline.recv() == "stop":
                    break
            except EOFError:  # the parent died
                log.warning("the process that started the engine is gone; stopping")
                break
    finally:
        server.close()
        # a compile still running (xgrammar's cannot be stopped: a 40,000-string enum takes tens of
        # seconds) held the exit until the parent killed this process, 15 s on; it ends with the process
        engine.shutdown(compile_wait_s=EXIT_COMPILE_WAIT_S)
        lifeline.close()
    logging.shutdown()
    os._exit(0)  # no interpreter teardown: a compile thread inside native code would abort it


def given_up_path(address: str) -> str:
    """Beside the engine's socket: the supervisor's word that it will not start the engine again,
    which every front-end process reads (no more reconnecting, no Retry-After to promise)."""
    return address + ".given-up"


def write_given_up(address: str, why: str) -> None:
    try:
        with open(given_up_path(address), "w") as f:
            f.write(why)
    except OSError as e:  # (its directory removed: the server is stopping anyway)
        log.warning("could not record that the engine is not started again: %s", e)


def read_given_up(address: str) -> str | None:
    try:
        with open(given_up_path(address)) as f:
            return f.read()
    except OSError:
        return None


class EngineProcess:
    """Starts the engine in a process of its own (spawned: the parent may hold threads and must not
    have touched CUDA) and stops it. `connect()` gives a front-end's `EngineClient`; `supervise()`
    starts it again, at the same address, if it dies (its clients reconnect by themselves)."""

    def __init__(self, config, ready_timeout_s: float = 600.0, response_store: str | None = None):
        self._config, self._response_store, self._ready_timeout_s = config, response_store, ready_timeout_s
        self._dir = tempfile.mkdtemp(prefix="constrained-spec-")
        self.address = os.path.join(self._dir, "engine.sock")
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._stopping = threading.Event()
        self.restarts = 0
        self.info: EngineInfo = self._start()

    def _start(self) -> EngineInfo:
        ctx = mp.get_context("spawn")
        try:
            os.unlink(self.address)  # a dead engine's socket file
        except OSError:
            pass
        self._lifeline, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(self._config, self.address, child_end, self._response_store),
                                   name="constrained-spec-engine", daemon=True)
        children.start(self.process)
        child_end.close()
        try:
            return self._wait_ready(self._ready_timeout_s)
        except BaseException:  # (Ctrl-C while it loads: it ignores the signal, and has served nothing)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            raise

    def supervise(self, max_restarts: int = 5, window_s: float = 600.0) -> None:
        """Watches the process from a thread: if it dies unasked (a crash in native code, the OOM
        killer), its requests in flight have failed; it is started again, unless it already died
        `max_restarts` times within `window_s` (then the server stays up, unhealthy, so that whoever
        runs it sees /health fail and the log says why)."""
        threading.Thread(target=self._watch, args=(max_restarts, window_s), name="engine-supervisor",
                         daemon=True).start()

    def _watch(self, max_restarts: int, window_s: float) -> None:
        from multiprocessing.connection import wait
        deaths: list[float] = []
        while True:
            wait([self.process.sentinel])
            if self._stopping.is_set():  # stopped: `stop` reaps it
                return
            self.process.join(5)  # reaped: its exit code, not None
            code = self.process.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            while True:  # a start that fails (it died again while loading) is one more death
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                deaths = [t for t in deaths if now - t < window_s] + [now]
                if len(deaths) > max_restarts:
                    why = (f"the engine process died ({how}), {len(deaths)} times within {window_s:.0f} s, and is "
                           f"not started again: the server must be restarted")
                    log.error("%s", why)
                    write_given_up(self.address, why)
                    return
                log.error("the engine process died (%s); starting it again", how)
                self._lifeline.close()
                try:
                    info = self._start()
                    break
                except (RuntimeError, TimeoutError) as e:
                    how = str(e)
                    log.error("the engine process could not start again: %s", e)
            if self._stopping.is_set():  # stopped while it started: stop this one too
                self._stopped = False
                self.stop()
                return
            self.info, self.restarts = info, self.restarts + 1
            log.info("the engine process is back (pid %d)", info.pid)

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        while not self._lifeline.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
            if time.monotonic() > deadline:  # (`_start` kills it: a restart may try again, not `stop`)
                raise TimeoutError(f"the engine process was not ready within {timeout_s:.0f} s")
        try:
            kind, value = self._lifeline.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
        if kind != "ready":
            self.process.join(10)
            raise RuntimeError(f"the engine process failed to start: {value}")
        return value

    def connect(self, owns_process: bool = False):
        """A new front-end connection. With `owns_process`, its `shutdown()` stops this process too."""
        from .engine_client import EngineClient
        return EngineClient(self.info, process=self if owns_process else None)

    def begin_shutdown(self) -> None:
        """The server's shutdown has begun: from now on the supervisor does not start the process
        again (a model load during the shutdown). `stop` stops it, once the requests drained."""
        self._stopping.set()

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Asks the engine to stop (it finishes its step, frees its threads), then makes sure. Safe
        to call more than once and from several threads (an app's shutdown and the process's owner
        may both stop it): the first call stops it, the others wait for that."""
        self._stopping.set()
        with self._stop_lock:
            if self._stopped:
                return
            try:
                self._lifeline.send("stop")
            except (OSError, ValueError):
                pass
            self.process.join(timeout_s)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
                self.process.kill()
                self.process.join(5)
            self._lifeline.close()
            try:
                os.rmdir(self._dir)
            except OSError:
                pass
            self._stopped = True
