"""Delivery of engine-thread updates to an asyncio event loop, a step's worth at a time.

`loop.call_soon_threadsafe` writes to the loop's wake-up pipe on every call; one call per request
per step makes a batch-64 step wake the loop 64 times, and each wake-up competes with the engine
thread for the GIL. A `LoopDelivery` queues the callbacks instead and asks the loop once to run
everything queued so far: the updates of one step (they are produced back to back) arrive together.
Order is kept.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Callable

__all__ = ["LoopDelivery"]

_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery]" = weakref.WeakKeyDictionary()
_by_loop_lock = threading.Lock()


class LoopDelivery:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopDelivery":
        """The loop's one delivery (shared by all its requests, so a step wakes it once)."""
        with _by_loop_lock:
            d = _by_loop.get(loop)
            if d is None:
                d = _by_loop[loop] = cls(loop)
            return d

    def put(self, fn: Callable[[Any], None], arg: Any) -> None:
        """From any thread: run fn(arg) on the loop, after everything put before it."""
        with self._lock:
            self._items.append((fn, arg))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed (shutdown): nothing to deliver to
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for fn, arg in items:
            fn(arg)
