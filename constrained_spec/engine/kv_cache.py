"""Token-slot KV bookkeeping: a pool of free slots (page size 1) and a request→slots table.

The K/V tensors themselves live in `attention.base.KVCache`; this module only decides which slot
holds which token. Alloc/free is exact: every slot handed out comes back when its request finishes,
is aborted, or has a draft token rejected, or passes to the prefix cache (`radix_cache.py`), which
gives it back when it evicts it.
"""
from __future__ import annotations

import numpy as np
import torch


class OutOfSlots(RuntimeError):
    pass


class SlotPool:
    """The free slots. With a prefix cache (`cache`, a `RadixCache` whose nodes own slots), slots
    the cache holds but no request uses count as free: `alloc` evicts them when the free list
    runs short, so everything that asks "can I have n slots" (`num_free`) sees them."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # Slot 0 is never handed out: padding in tables and graphs may write there harmlessly.
        self._free = np.arange(num_slots - 1, 0, -1, dtype=np.int64)
        self._top = num_slots - 1
        self.cache = None

    @property
    def num_free(self) -> int:
        """Slots `alloc` can hand out: free ones, and the prefix cache's evictable ones."""
        cache = self.cache
        return self._top if cache is None else self._top + cache.evictable_size

    @property
    def num_unused(self) -> int:
        """Slots on the free list (neither a request's nor the prefix cache's)."""
        return self._top

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def alloc(self, n: int) -> np.ndarray:
        if n > self._top and self.cache is not None:
            self.cache.evict(n - self._top)  # a few heap pops: the tree keeps its candidates
        if n > self._top:
            raise OutOfSlots(f"asked for {n} KV slots, {self._top} free")
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if self._top + n > self.capacity:
            raise RuntimeError("KV slot double free")
        self._free[self._top:self._top + n] = slots
        self._top += n


class RequestSlotTable:
    """Row r holds the slots of one running request's context, in token order.

    A host copy is the source of truth; the device copy is updated with the few slots each step adds
    and read by attention through `rows`.
    """

    def __init__(self, max_rows: int, max_context: int, device: torch.device | str):
        self.max_context = max_context
        self.pad_row = max_rows  # one spare row that padded batch entries may scribble on
        self.host = np.zeros((max_rows + 1, max_context), dtype=np.int64)
        self.device_table = torch.zeros((max_rows + 1, max_context), dtype=torch.int64, device=device)
        self.lengths = np.zeros(max_rows + 1, dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def take_row(self) -> int:
        row = self._free_rows.pop()
        self.lengths[row] = 0
        return row

    def release_row(self, row: int, start: int = 0) -> np.ndarray:
        """Frees the row and returns its slots from `start` on (for the pool; the prefix cache's
        own, before `start`, are not the row's to give back)."""
        slots = self.host[row, start:self.lengths[row]].copy()
        self.lengths[row] = 0
        self._free_rows.append(row)
        return slots

    def append(self, row: int, slots: np.ndarray) -> tuple[int, int]:
        """Appends slots to a row on the host; returns the (start, end) range written."""
        start = int(self.lengths[row])
        end = start + len(slots)
        if end > self.max_context:
            raise OutOfSlots(f"context of {end} tokens exceeds the maximum of {self.max_context}")
        self.host[row, start:end] = slots
        self.lengths[row] = end
        return start, end

    def truncate(self, row: int, length: int) -> np.ndarray:
        """Drops slots past `length` (rejected draft tokens); returns them for the pool."""
        dropped = self.host[row, length:self.lengths[row]].copy()
        self.lengths[row] = length
        return dropped

    def write_device(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Mirrors newly appended slots on the device: table[rows[i], positions[i]] = slots[i]."""
        self.write_device_flat(rows * self.max_context + positions, slots)

    def write_device_flat(self, flat: torch.Tensor, slots: torch.Tensor) -> None:
        """`write_device` with the indices into the flattened table (row * max_context + position)
        computed already (on the host: two kernel launches fewer)."""
        self.device_table.view(-1).index_copy_(0, flat, slots)
