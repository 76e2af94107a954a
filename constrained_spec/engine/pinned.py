"""Pinned host staging for the per-step host-to-device copies of the graphed paths.

A copy with non_blocking=True reads its pinned source when the stream reaches it, so the source must
not be rewritten before then. `PinnedStaging` keeps two pinned buffers and hands them out in turn;
a buffer is rewritten two copies after it was read, once the event recorded behind its copy has
completed. In the engine loop it always has by then (step N+1 is launched after step N-1's results
were waited for, and the stream ran step N-1's copies before them), so `stage` does not block there;
the event keeps it safe where that wait is skipped (a failed step's results are dropped unread).
"""
from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self._host = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
        self._host_np = [t.numpy() for t in self._host]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self) -> np.ndarray:
        """The next buffer, free to write: fill it, then `copy_to` the device."""
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        return self._host_np[self._turn]

    def copy_to(self, dst: torch.Tensor, rows: int | None = None) -> None:
        """Copies the staged buffer (its first `rows` rows) into `dst` on the current stream and
        passes the turn to the other buffer."""
        k = self._turn
        src = self._host[k] if rows is None else self._host[k][:rows]
        dst.copy_(src, non_blocking=True)
        if self._copied[k] is None:
            self._copied[k] = torch.cuda.Event()
        self._copied[k].record()
        self._turn = 1 - k
