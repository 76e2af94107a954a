"""Stored Responses (`store`, on by default as in OpenAI's API): each stored response's object, for
``GET /v1/responses/{id}``; the conversation it ends, for a later request's `previous_response_id`:
the chat turns it was given (the previous conversation's, then its own input; never its
instructions, which OpenAI does not carry over) and its output as assistant turns; and its input
items as the Responses API lists them (``GET /v1/responses/{id}/input_items``).

In memory, bounded: beyond `max_responses` entries or `max_bytes` of their JSON, the least recently
used go first. A restart forgets them all. With several front-end processes the store lives in the
engine process (one store, whichever front-end a request reaches) and the front-ends ask for it by
calls over their connection (`EngineClient.responses_async`).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # id -> JSON of [response, messages, items]
        self._bytes = 0
        self._lock = threading.Lock()  # the engine process's connection threads share one store

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict:
        """For /metrics: how many responses are stored, and the bytes of their JSON."""
        return {"responses": len(self._entries), "bytes": self._bytes}

    def put(self, response_id: str, blob: bytes) -> None:
        """Keeps a response's JSON (`[response, messages, items]`, encoded by the front-end: the
        engine process, whose engine thread needs the GIL, only moves bytes)."""
        with self._lock:
            self._drop(response_id)
            if len(blob) > self.max_bytes:
                return  # larger than the whole store: kept nowhere (a later lookup says not found)
            self._entries[response_id] = blob
            self._bytes += len(blob)
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> bytes | None:
        with self._lock:
            blob = self._entries.get(response_id)
            if blob is not None:
                self._entries.move_to_end(response_id)
            return blob

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def call(self, op: str, response_id: str, value=None):
        """One operation by name, as a front-end's call names it: put (value: the JSON bytes), get
        or delete."""
        if op == "put":
            return self.put(response_id, value)
        if op == "get":
            return self.get(response_id)
        if op == "delete":
            return self.delete(response_id)
        raise ValueError(f"unknown response store operation {op!r}")

    def _drop(self, response_id: str) -> bool:
        blob = self._entries.pop(response_id, None)
        if blob is None:
            return False
        self._bytes -= len(blob)
        return True
