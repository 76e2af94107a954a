"""The front-end's side of the engine process: an `EngineClient` the HTTP app uses as it uses an
in-process Engine (`add_request`, `abort`, `grammar.compile_async`, `tokenizer`, `chat_prompt`).

It detokenizes: the engine process sends token ids, and a reader thread here turns each step's
message into `RequestOutput`s with text, using the same `IncrementalDetokenizer` the engine uses
in-process, so answers are the same text. Stop strings are found here too; a request that hits one
ends here and is aborted in the engine (the tokens the engine made meanwhile are dropped).

If the engine process dies, the connection closes: every request in flight ends with an error, the
client turns unhealthy, and new requests raise `EngineUnavailable` (the app answers 503).
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable

from ..engine.detokenizer import IncrementalDetokenizer
from ..engine.chat_prompt import ChatPromptEncoder
from ..engine.config import EngineConfig
from ..engine.engine import RequestError
from ..engine.request import FinishReason, RequestOutput
from . import ipc
from .engine_process import read_given_up

log = logging.getLogger("constrained_spec.engine_client")


class EngineUnavailable(RuntimeError):
    """The engine process is not running (it died, or was stopped)."""


@dataclass
class _Pending:
    """A request in flight, as the front-end sees it (also what the /metrics listeners read)."""
    key: int
    request_id: str
    prompt_ids: list[int]
    on_output: Callable[[RequestOutput], None]
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # a non-streamed request without stop strings: the engine sends its first token and then the
    # rest at its end (`each_step=False`); it is detokenized once, at the end
    whole: bool = False
    logprobs: list = field(default_factory=list)
    # prompt tokens from the prefix cache: the engine's full updates carry it, a step's streamed
    # tokens do not (an answer a stop string ends here, on one of those, reports it all the same)
    cached: int = 0


@dataclass
class _Limits:
    """The engine's limits the app reads (`engine.config` of an in-process engine)."""
    max_running_requests: int
    max_queued_requests: int

    max_held_requests = EngineConfig.max_held_requests  # the engine's own rule, on these two fields


class _Listeners:
    """`engine.stats.listeners` of an in-process engine: /metrics hooks its TTFT and latency here."""

    def __init__(self):
        self.listeners: list = []


class _RemoteGrammar:
    def __init__(self, client: "EngineClient"):
        self._client = client

    def compile_async(self, spec, check_only: bool = True) -> Future:
        """Compiles (or finds in the engine's cache) in the engine process: resolves to None, or
        raises GrammarError / GrammarBusy as an in-process compile would. Always the server's
        up-front check (`check_only`): the request's own compile is the engine's. Cancelling the
        future (its client left) cancels the compile's future in the engine process, so the
        compile queue has no waiter left on the job there."""
        return self._client._call("compile", spec, cancellable=True)


def _settle(future: Future | None, ok: bool, value) -> None:
    """A call's reply into its future, unless its caller gave up on it meanwhile (a `/health` whose
    snapshot took past its timeout): setting a cancelled future raised in the reader thread, which
    then failed every request in flight as if the engine had died (QA 1130b soak D3)."""
    if future is None or future.done() or not future.set_running_or_notify_cancel():
        return
    future.set_result(value) if ok else future.set_exception(value)


class EngineClient:
    def __init__(self, info, process=None):
        self.info = info
        self._process = process  # the EngineProcess this client stops on shutdown, if it owns it
        self.model_name = info.model_name
        self.tokenizer = info.tokenizer
        self.chat_prompt = ChatPromptEncoder(self.tokenizer)  # (messages, add_generation_prompt=True) -> ids
        self.max_context = info.max_context
        self.device = info.device
        self.config = _Limits(info.max_running_requests, info.max_queued_requests)
        self.grammar = _RemoteGrammar(self)
        self.stats = _Listeners()
        self._channel = self._open_channel()
        self._keys = itertools.count(1)
        self._by_key: dict[int, _Pending] = {}
        self._by_id: dict[str, _Pending] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # the dicts above, between the app's threads and the reader
        self.healthy = True
        self.given_up: str | None = None  # why the engine will not come back (its supervisor gave up)
        self.closed = False
        self._reader = self._start_reader()

    def _open_channel(self) -> ipc.Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.info.address)
        except OSError:
            sock.close()
            raise
        return ipc.Channel(sock)

    def _start_reader(self) -> threading.Thread:
        reader = threading.Thread(target=self._read_loop, args=(self._channel,), name="engine-client-reader",
                                  daemon=True)
        reader.start()
        return reader

    # -- what the app calls ------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params, grammar=None, on_output=None, request_id: str | None = None,
                    stream: bool = True) -> _Pending:
        """Queues a request in the engine; `on_output` is called from this client's reader thread,
        once per engine step that made tokens for it, or (`stream=False`) possibly only once, at the
        end, with everything. Raises RequestError for what the engine would refuse up front,
        EngineUnavailable if it is gone."""
        self._check_up()
        ids = list(prompt)
        self._check_length(ids)
        with self._lock:
            # running and waiting: what the engine holds at most (one front-end's share of it)
            if len(self._by_key) >= self.config.max_held_requests:
                raise RequestError("the engine's queue is full; retry later", code="queue_full")
            key = next(self._keys)
            p = _Pending(key, request_id or f"req-{key}", ids, on_output or (lambda out: None),
                         IncrementalDetokenizer(self.tokenizer, ids, params.stop), whole=not stream and not params.stop)
            self._by_key[key] = p
            self._by_id[p.request_id] = p
        try:
            self._channel.send(("add", key, p.request_id, ids, params, grammar, p.whole))
        except OSError:
            self._forget(p)
            self._lost()
            raise EngineUnavailable("the engine process is not running")
        return p

    def abort(self, request_id: str) -> None:
        with self._lock:
            p = self._by_id.get(request_id)
        if p is None:
            return
        self._forget(p)
        self._send_quietly(("abort", p.key))
        # its end will not come back (it is forgotten): /metrics counts it here, as the engine does
        p.finish_reason = FinishReason.ABORT
        for fn in self.stats.listeners:
            fn("finish", p)

    def snapshot_async(self) -> Future:
        """The engine's state for /health and /metrics (`metrics.engine_snapshot`)."""
        return self._call("snapshot", None)

    def responses_async(self, op: str, response_id: str, value=None) -> Future:
        """An operation on the engine process's stored Responses (`ResponseStore.call`)."""
        return self._call("responses", (op, response_id, value))

    def shutdown(self) -> None:
        """Closes this front-end's connection (the engine aborts its requests); stops the engine
        process too if this client owns it."""
        if self.closed:
            return
        self.closed = True
        self._channel.close()
        self._reader.join(5)
        if self._process is not None:
            self._process.stop()

    # -- internals -------------------------------------------------------------------------------
    def _check_up(self) -> None:
        if not self.healthy:
            raise EngineUnavailable("the engine process is not running")

    def _check_length(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's context holds {self.max_context}",
                               param="messages", code="context_length_exceeded")
        if len(ids) + 1 > self.info.kv_capacity:
            raise RequestError(f"the prompt has {len(ids)} tokens; the KV cache holds {self.info.kv_capacity}",
                               param="messages", code="context_length_exceeded")

    def _call(self, name: str, arg, cancellable: bool = False) -> Future:
        if not self.healthy:
            future: Future = Future()
            future.set_exception(EngineUnavailable("the engine process is not running"))
            return future
        return self._send_call(name, arg, cancellable)

    def _send_call(self, name: str, arg, cancellable: bool = False) -> Future:
        future: Future = Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        if not self._send_quietly(("call", call_id, name, arg)):
            with self._lock:
                self._calls.pop(call_id, None)
            future.set_exception(EngineUnavailable("the engine process is not running"))
        elif cancellable:
            future.add_done_callback(lambda f: f.cancelled() and self._cancel_call(call_id))
        return future

    def _cancel_call(self, call_id: int) -> None:
        """A call its caller cancelled: forgotten here, and cancelled in the engine process."""
        with self._lock:
            self._calls.pop(call_id, None)
        self._send_quietly(("cancel", call_id))

    def _send_quietly(self, message: tuple) -> bool:
        try:
            self._channel.send(message)
            return True
        except OSError:
            return False

    def _forget(self, p: _Pending) -> None:
        with self._lock:
            self._by_key.pop(p.key, None)
            self._by_id.pop(p.request_id, None)

    def _read_loop(self, channel: ipc.Channel) -> None:
        try:
            while True:
                msg = channel.recv()
                if msg[0] == "out":
                    self._on_updates(msg[1], msg[2])
                else:
                    _, call_id, ok, value = msg
                    with self._lock:
                        future = self._calls.pop(call_id, None)
                    _settle(future, ok, value)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("engine client reader failed")
        finally:
            self._lost()

    def _on_updates(self, tokens: list[tuple], updates: list[tuple]) -> None:
        """A step's message: streamed tokens (key, token, logprob, tokens so far), then updates."""
        if tokens:
            updates = [(key, [token], False, None, None, None, n, [lp] if lp else None, 0, None)
                       for key, token, lp, n in tokens] + updates
        by_key = self._by_key
        for key, ids, finished, reason, error, matched, n_out, lps, cached, error_kind in updates:
            p = by_key.get(key)
            if p is None:  # aborted here, or ended here on a stop string
                continue
            if p.first_token_time is None and ids:
                p.first_token_time = time.monotonic()
                for fn in self.stats.listeners:
                    fn("first_token", p)
            detok = p.detok
            p.output_ids.extend(ids)
            p.cached = cached = max(p.cached, cached)
            if p.whole:
                if lps:
                    p.logprobs.extend(lps)
                if not finished:
                    continue
                ids, lps = p.output_ids, p.logprobs or None
            feed = ids[:-1] if finished and isinstance(matched, int) else ids  # a stop token is no text
            if detok.stop:
                at, stop = self._stop_at(detok, feed)
                if stop is not None:  # ends here, on the token that completes the stop string
                    if not finished:
                        self._send_quietly(("abort", key))
                    self._forget(p)
                    cut = len(ids) - at - 1
                    text = detok.take(True)
                    ids, lps = detok.release(ids[:at + 1], lps[:at + 1] if lps else lps, True)
                    self._deliver(p, RequestOutput(p.request_id, text, ids, True, FinishReason.STOP, None,
                                                   len(p.prompt_ids), n_out - cut, lps, stop, cached))
                    continue
            elif p.whole:
                _add_whole(detok, feed)
            elif feed:
                detok.add(feed)
            if finished:
                self._forget(p)
            text = detok.take(finished)
            if detok.stop:  # the tokens go out with their text (a stop string's never)
                ids, lps = detok.release(ids, lps, finished)
            out = RequestOutput(p.request_id, text, ids, finished,
                                None if reason is None else FinishReason(reason), error, len(p.prompt_ids), n_out,
                                lps, matched, cached, error_kind)
            self._deliver(p, out)

    @staticmethod
    def _stop_at(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[int, str | None]:
        """Feeds a request with stop strings token by token, as the engine would: the position of
        the token that completes a stop string, and the stop string (None if no token does)."""
        for j, tok in enumerate(ids):
            stop = detok.add([tok])
            if stop is not None:
                return j, stop
        return len(ids), None

    def _deliver(self, p: _Pending, out: RequestOutput) -> None:
        if out.finished:
            p.finish_reason = out.finish_reason
            for fn in self.stats.listeners:
                fn("finish", p)
        try:
            p.on_output(out)
        except Exception:
            log.exception("output callback of %s failed", p.request_id)

    def _lost(self) -> None:
        """The connection is gone: fail everything in flight (unless this client closed it)."""
        if not self.closed:
            log.error("lost the engine process: failing %d requests in flight", len(self._by_key))
        self.healthy = False
        with self._lock:
            pending, self._by_key, self._by_id = list(self._by_key.values()), {}, {}
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if not future.done():
                future.set_exception(EngineUnavailable("the engine process is not running"))
        for p in pending:
            self._deliver(p, RequestOutput(p.request_id, p.detok.take(True), [], True, FinishReason.ERROR,
                                           ENGINE_GONE, len(p.prompt_ids), len(p.output_ids)))
        if not self.closed:
            threading.Thread(target=self._reconnect, name="engine-client-reconnect", daemon=True).start()

    def _reconnect(self, every_s: float = 0.5) -> None:
        """Connects again once the engine process is back at its address (`EngineProcess.supervise`
        starts it again); until then requests get 503 and /health says unhealthy."""
        while not self.closed:
            time.sleep(every_s)
            try:
                channel = self._open_channel()
            except OSError:
                self.given_up = read_given_up(self.info.address)
                if self.given_up is not None:
                    log.error("%s", self.given_up)
                    return
                continue
            if self.closed:
                channel.close()
                return
            self._channel = channel
            self._reader = self._start_reader()
            if not self._refresh_info():
                return  # gone again: the reader's `_lost` reconnects once more
            self.healthy = True
            log.info("connected to the engine process again (pid %d)", self.info.pid)
            return

    def _refresh_info(self, timeout_s: float = 30.0) -> bool:
        """The engine started again may differ from the last (its KV capacity follows the device
        memory free at its start): the limits the app checks requests against are asked anew.
        False if the engine went away meanwhile."""
        try:
            info = self._send_call("info", None).result(timeout_s)
        except EngineUnavailable:
            return False
        except Exception as e:  # slow to answer: it serves, with the limits of the last start
            log.warning("could not ask the engine process for its limits again: %s", e)
            return True
        self.info = replace(info, tokenizer=self.tokenizer)
        self.max_context = info.max_context
        self.config = _Limits(info.max_running_requests, info.max_queued_requests)
        return True


ENGINE_GONE = "the engine process stopped"


def _add_whole(detok: IncrementalDetokenizer, ids: list[int]) -> None:
    """A whole answer into its detokenizer in one decode, with the text a token-by-token feed gives:
    the detokenizer keeps back text that ends in a cut character (U+FFFD), so the tokens of a
    character the answer ends inside of (it hit max_tokens there) go in one by one after the rest."""
    k = len(ids)
    while k > 0 and len(ids) - k < 4 and detok._decode(ids[max(k - 8, 0):k]).endswith("\ufffd"):
        k -= 1
    if k:
        detok.add(ids[:k])
    for tok in ids[k:]:
        detok.add([tok])
