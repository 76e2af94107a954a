"""The messages between the HTTP front-end process and the engine process, and their framing.

A connection is a stream socket (a Unix socket; the engine process listens, each front-end
connects). A message is a 4-byte little-endian length and a pickle of a plain tuple: pickle of
tuples of ints, strings and lists is C code both ways and needs no schema; the few richer objects
(SamplingParams, GrammarSpec, a GrammarError) are small dataclasses and exceptions.

Front-end -> engine:
    ("add", key, request_id, prompt_ids, SamplingParams, GrammarSpec | None, whole)
                                          whole: answered in one piece (the engine sends the first
                                          update and the last, which carries every token since)
    ("abort", key)
    ("call", call_id, name, arg)          name: "compile" (arg: GrammarSpec) or "snapshot" (arg: None)
    ("cancel", call_id)                   a "compile" its caller gave up on (its client left): the
                                          compile's future there is cancelled (no reply comes)
Engine -> front-end:
    ("out", [Token, ...], [Update, ...])  one message per engine step: its streamed tokens, then
                                          every other update of the step
    ("reply", call_id, ok, value)         value: the result, or the exception raised

`key` is the front-end's number for a request on its connection. An Update is the tuple
(key, new_token_ids, finished, finish_reason | None, error | None, matched_stop, completion_tokens,
logprobs | None, cached_tokens, error_kind | None): token ids only; the front-end detokenizes and
finds stop strings. cached_tokens: the prompt tokens the engine's prefix cache served
(usage.prompt_tokens_details). error_kind: what an "error" end was (`RequestOutput.error_kind`: its
grammar busy in the compile queue, or refused), so the front-end answers 503 or 400, not 500.
A Token, (key, token_id, logprob | None, completion_tokens), is a streamed request's update of one
more token that does not end it, the most common one, kept small (`Engine.add_request(step_tokens=)`).
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("<I")

# positions in an Update tuple
KEY, TOKENS, FINISHED, REASON, ERROR, MATCHED, COMPLETION_TOKENS, LOGPROBS, CACHED_TOKENS, ERROR_KIND = range(10)


class Channel:
    """One end of a connection: `send` from any thread, `recv` from one reader thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb", buffering=1 << 20)
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> Any:
        """The next message; raises EOFError when the other end has closed."""
        head = self._reader.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise EOFError("connection closed")
        (n,) = _HEADER.unpack(head)
        payload = self._reader.read(n)
        if len(payload) < n:
            raise EOFError("connection closed mid-message")
        return pickle.loads(payload)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
