"""A least-recently-used map bounded by count and by bytes, for the grammar layer's caches (the
compiled grammars, the normalized schemas). Not thread-safe: its owners call it under their lock."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable


class BoundedLRU:
    """`size_of(key, value)` is what an entry counts against `max_bytes`. An entry larger than the
    whole bound is not kept, nor does it push the others out."""

    def __init__(self, max_count: int, max_bytes: int, size_of: Callable[[Any, Any], int]):
        self.max_count, self.max_bytes, self._size_of = max_count, max_bytes, size_of
        self._entries: "OrderedDict[Any, Any]" = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key):
        return self._entries[key]

    def get(self, key, default=None):
        """The value for `key` (now the most recently used), or `default`."""
        value = self._entries.get(key)
        if value is None:
            return default
        self._entries.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= self._size_of(key, old)
        size = self._size_of(key, value)
        if size > self.max_bytes:
            return
        self._entries[key] = value
        self.bytes += size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            self.bytes -= self._size_of(*self._entries.popitem(last=False))
