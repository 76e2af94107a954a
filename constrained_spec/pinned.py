"""Pinned host staging for the per-step host-to-device copies of the graphed paths: `PinnedStaging`
for inputs copied before a graph replays, `PinnedBlock` for inputs a graph copies itself.

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
        pin = torch.cuda.is_available()  # off CUDA (tests of the layouts staged here) plain memory
        self._host = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
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
        if dst.device.type == "cuda":
            if self._copied[k] is None:
                self._copied[k] = torch.cuda.Event()
            record_on_current_stream(self._copied[k], dst.device.index)
        self._turn = 1 - k


class GrowingStaging:
    """`PinnedStaging` for copies whose size varies from step to step (int64 entries; the buffers
    double when a copy needs more), landing in a device buffer of the same capacity. Off CUDA the
    staged array is the tensor itself. Replacing a buffer is safe while a copy from it is in flight:
    torch's pinned-memory cache records the copy and reuses the block only after it."""

    def __init__(self, device: torch.device, capacity: int = 1 << 12):
        self.device = device
        self._cuda = device.type == "cuda"
        self._cpu = np.empty(0, np.int64)  # off CUDA: the array staged last, uploaded as it is
        self._staging: PinnedStaging | None = None
        self._dev: torch.Tensor | None = None
        self._capacity = 0
        if self._cuda:
            self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        # Buffers grown inside an inference_mode step (the runner's plan) would be inference
        # tensors, which a later upload from outside one (the scheduler's) may not write.
        with torch.inference_mode(False):
            self._capacity = capacity
            self._staging = PinnedStaging((capacity,), torch.int64)
            self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def stage(self, n: int) -> np.ndarray:
        """A host array of n entries to fill, then `upload(n)`."""
        if not self._cuda:
            self._cpu = np.empty(n, np.int64)
            return self._cpu
        if n > self._capacity:
            self._grow(max(n, 2 * self._capacity))
        return self._staging.stage()[:n]

    def upload(self, n: int) -> torch.Tensor:
        """The staged n entries on the device (valid until the next upload: stream order)."""
        if not self._cuda:
            return torch.from_numpy(self._cpu)
        self._staging.copy_to(self._dev[:n], n)
        return self._dev[:n]


def record_on_current_stream(event: torch.cuda.Event, device_index: int) -> None:
    """`event.record()` for a known device: a bare `record()` finds the current device through
    `torch.cuda.is_available()` at every call, which one H100 host's profile of a loaded engine
    thread put at ~5% of its samples."""
    event.record(torch.cuda.current_stream(device_index))


class PinnedBlock:
    """Host fields packed in one pinned buffer, with a device twin that one copy fills (`upload`).
    For the inputs a CUDA graph copies itself: the graph captures the copy, so both buffers keep
    their addresses for good and a single buffer is used, rewritten only once the step that read
    it has been waited for (the speculative step writes step N+1's inputs after reading step N's
    results). On the CPU the device twin is the host buffer itself and `upload` does nothing.

    `fields` maps a name to (shape, numpy dtype); each field starts on an 8-byte boundary.
    `host[name]` is its numpy view, `host_tensor[name]` the same as a torch tensor, `device[name]`
    its torch view on the device."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], type]], device: torch.device):
        offsets, end = {}, 0
        for name, (shape, dtype) in fields.items():
            offsets[name] = end
            end += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 8) * 8
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(max(end, 8), dtype=torch.uint8, pin_memory=on_cuda)
        self._device = torch.zeros_like(self._host, device=device) if on_cuda else self._host
        raw = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.host_tensor: dict[str, torch.Tensor] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in fields.items():
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            start, torch_dtype = offsets[name], _TORCH_DTYPES[np.dtype(dtype)]
            self.host[name] = raw[start:start + n].view(dtype).reshape(shape)
            self.host_tensor[name] = self._host[start:start + n].view(torch_dtype).view(shape)
            self.device[name] = self._device[start:start + n].view(torch_dtype).view(shape)
        self._offsets = offsets

    def upload(self, upto: str | None = None, nbytes: int | None = None) -> None:
        """Copies the block to the device (non-blocking, capturable); with `upto` and `nbytes`, only
        up to `nbytes` bytes into field `upto` (a prefix of rows of the last field)."""
        if self._device is self._host:
            return
        end = None if upto is None else self._offsets[upto] + nbytes
        if end is None:
            self._device.copy_(self._host, non_blocking=True)
        else:
            self._device[:end].copy_(self._host[:end], non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}
