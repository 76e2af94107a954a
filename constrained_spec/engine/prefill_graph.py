"""The device side of a graphed prefill: one request's new tokens (a prompt, a prompt chunk, or the
grammar-forced tokens of a jump-forward), padded up to a bucket of T tokens and replayed as one
CUDA graph per bucket (`CudaGraphRunner.capture_prefill`).

Why: run eagerly, a prefill pays one host launch per kernel (~27 us each on the H100): 12-15 ms
for SmolLM2's ~400 kernels whatever the prompt's length, as much as fifteen decode steps, so at
batch 1 a ~100-token JSON answer spent ~15% of its time in its prefill. Replayed, the same work
is one graph launch.

Layout of the per-step inputs (one int64 buffer, one host-to-device copy):
  ids[T] | positions[T] | slots[T] | table rows[T] | row, 0, n, kv_len
Tokens [n, T) are padding: they sit on the spare table row at column 0, write their K/V to the
reserved slot 0, and no real token attends to them (q_lens = n); their rows of every activation
are garbage that nothing reads.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..pinned import PinnedStaging


class PrefillIO:
    """Static buffers and the captured work of the prefill bucket of `tokens` tokens."""

    def __init__(self, runner, tokens: int):
        self.r = runner
        self.tokens = T = tokens
        self._staging = PinnedStaging((4 * T + 4,), torch.int64)
        self._dev = torch.zeros(4 * T + 4, dtype=torch.int64, device=runner.device)
        self._ids, self._positions, self._slots, self._table_rows = self._dev[:4 * T].view(4, T)
        tail = self._dev[4 * T:]
        self._row, self._q_starts, self._n, self._kv_len = tail[0:1], tail[1:3], tail[2:3], tail[3:4]
        self.set_inputs(runner.pad_row, np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
        self.copy_inputs()

    @property
    def row(self) -> torch.Tensor:
        """The request's table row on the device ([1]; valid until the next prefill's copy)."""
        return self._row

    def set_inputs(self, row: int, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                   kv_len: int) -> None:
        T, n, h = self.tokens, len(ids), self._staging.stage()
        fields = h[:4 * T].reshape(4, T)
        fields[0, :n], fields[1, :n], fields[2, :n], fields[3, :n] = ids, positions, slots, row
        fields[:3, n:] = 0
        fields[3, n:] = self.r.pad_row
        h[4 * T:] = (row, 0, n, kv_len)

    def copy_inputs(self) -> None:
        """Sends what `set_inputs` staged (a pinned buffer; the next call stages in the other)."""
        self._staging.copy_to(self._dev)

    def forward(self) -> torch.Tensor:
        """Logits [1, V] float32 of the request's last new token."""
        r = self.r
        r.table.write_device(self._table_rows, self._positions, self._slots)
        meta = AttentionMetadata(
            mode=ForwardMode.EXTEND, out_slots=self._slots, q_starts=self._q_starts.to(torch.int32),
            q_lens=self._n.to(torch.int32), kv_lens=self._kv_len.to(torch.int32),
            slot_table=r.table.device_table[self._row], max_q_len=self.tokens, max_kv_len=r.max_context)
        hidden = r.run_model(self._ids, self._positions, meta)
        return r.model.compute_logits(hidden.index_select(0, self._n - 1)).float()
