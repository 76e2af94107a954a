"""Stored Responses (`store`, on by default as in OpenAI's API): each stored response's object, for
``GET /v1/responses/{id}``; the conversation it ends, for a later request's `previous_response_id`:
the chat turns it was given (the previous conversation's, then its own input; never its
instructions, which OpenAI does not carry over) and its output as assistant turns; and its input
items as the Responses API lists them (``GET /v1/responses/{id}/input_items``).

Bounded: beyond `max_responses` entries or `max_bytes` of their JSON, the least recently used go
first. In memory only by default (a restart forgets them); with a `path` (`serve --response-store
FILE`) every change is also written to a SQLite file by a thread of its own, so that a request
never waits for the disk, and a restarted server finds the responses again, in the same order of
use. With several front-end processes the store lives in the engine process (one store, whichever
front-end a request reaches) and the front-ends ask for it by calls over their connection
(`EngineClient.responses_async`).
"""
from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("constrained_spec.responses")

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES,
                 path: str | os.PathLike | None = None):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # id -> JSON of [response, messages, items]
        self._bytes = 0
        self._lock = threading.Lock()  # the engine process's connection threads share one store
        self._disk = None if path is None else ResponseFile(path)
        if self._disk is not None:
            loaded = self._disk.load()  # least recently used first: the limits drop those
            with self._lock:
                for response_id, blob in loaded:
                    self._keep(response_id, blob)
            self._disk.start()
            log.info("stored responses: %d from %s", len(self._entries), path)

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict:
        """For /metrics: how many responses are stored, and the bytes of their JSON."""
        return {"responses": len(self._entries), "bytes": self._bytes}

    def put(self, response_id: str, blob: bytes) -> None:
        """Keeps a response's JSON (`[response, messages, items]`, encoded by the front-end: the
        engine process, whose engine thread needs the GIL, only moves bytes)."""
        with self._lock:
            self._keep(response_id, blob)

    def get(self, response_id: str) -> bytes | None:
        with self._lock:
            blob = self._entries.get(response_id)
            if blob is not None:
                self._entries.move_to_end(response_id)
                if self._disk is not None:
                    self._disk.touch(response_id)
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

    def close(self) -> None:
        """Writes what is still queued for the file and closes it (nothing to do in memory only)."""
        if self._disk is not None:
            self._disk.close()

    def _keep(self, response_id: str, blob: bytes) -> None:
        self._drop(response_id)
        if len(blob) > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a later lookup says not found)
        self._entries[response_id] = blob
        self._bytes += len(blob)
        if self._disk is not None:
            self._disk.put(response_id, blob)
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> bool:
        blob = self._entries.pop(response_id, None)
        if self._disk is not None:
            self._disk.delete(response_id)  # also where only the file has it (loaded past the limits)
        if blob is None:
            return False
        self._bytes -= len(blob)
        return True


class ResponseFile:
    """The store's entries in a SQLite file: `load` them once, then each change is queued and a
    writer thread commits what has queued up in one transaction. `used` orders them by last use
    (a counter, continued from the file's largest), as the store's LRU order does."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
            self._db.execute("CREATE TABLE IF NOT EXISTS responses "
                             "(id TEXT PRIMARY KEY, blob BLOB NOT NULL, used INTEGER NOT NULL)")
        except (OSError, sqlite3.Error) as e:
            raise RuntimeError(f"cannot use {path} as the stored responses' file: {e}") from e
        self.path = path
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._used = 0
        self._thread: threading.Thread | None = None
        self._failed = False

    def load(self) -> list[tuple[str, bytes]]:
        rows = self._db.execute("SELECT id, blob, used FROM responses ORDER BY used").fetchall()
        self._used = rows[-1][2] if rows else 0
        return [(r[0], bytes(r[1])) for r in rows]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="response-store-writer", daemon=True)
        self._thread.start()

    def put(self, response_id: str, blob: bytes) -> None:
        self._used += 1
        self._ops.put(("INSERT OR REPLACE INTO responses (id, blob, used) VALUES (?, ?, ?)",
                       (response_id, blob, self._used)))

    def touch(self, response_id: str) -> None:
        self._used += 1
        self._ops.put(("UPDATE responses SET used = ? WHERE id = ?", (self._used, response_id)))

    def delete(self, response_id: str) -> None:
        self._ops.put(("DELETE FROM responses WHERE id = ?", (response_id,)))

    def close(self) -> None:
        if self._thread is not None:
            self._ops.put(None)
            self._thread.join(30)
            self._thread = None
        self._db.close()

    def _write_loop(self) -> None:
        while True:
            first = self._ops.get()
            ops = self._drain([] if first is None else [first])
            self._write(ops)
            if first is None or None in ops:
                return

    def _drain(self, ops: list) -> list:
        while True:
            try:
                ops.append(self._ops.get_nowait())
            except queue.Empty:
                return ops

    def _write(self, ops: list) -> None:
        ops = [op for op in ops if op is not None]
        if not ops:
            return
        try:
            self._db.execute("BEGIN")
            for sql, args in ops:
                self._db.execute(sql, args)
            self._db.execute("COMMIT")
            self._failed = False
        except sqlite3.Error as e:  # a full disk: the store goes on in memory; say so once
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if not self._failed:
                log.error("stored responses: writing %s failed (%s); %d changes are not on disk", self.path, e,
                          len(ops))
            self._failed = True
