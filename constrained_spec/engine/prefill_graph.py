"""The device side of a graphed prefill: up to R requests' new tokens (prompts, prompt chunks, the
grammar-forced tokens of a jump-forward), T tokens in all, padded up to a bucket (T, R) and
replayed as one CUDA graph per bucket (`CudaGraphRunner.capture_prefill`).

Why: run eagerly, a prefill pays one host launch per kernel (~27 us each on the H100): 12-15 ms
for SmolLM2's ~400 kernels whatever the prompts' length, as much as fifteen decode steps. A server's
requests arrive a few at a time, so under load most prefills hold several requests; replayed, each
is one graph launch.

Layout of the per-step inputs (one int64 buffer, one host-to-device copy of its used part):
  ids[T] | positions[T] | slots[T] | table rows[T] | rows[R] | q_starts[R+1] | q_lens[R] | kv_lens[R]
  | sample_tokens[R] | sample_rows[R] | num_writes[1] | writes[W, 2]
Tokens [n, T) are padding: they sit on the spare table row at column 0, write their K/V to the
reserved slot 0, and no real token attends to them; padding requests have no new tokens
(q_len 0, so attention skips them). Their rows of every activation are garbage that nothing reads.
`writes` are up to W = T + WRITES_PER_REQUEST * R more table entries (flat table index, slot),
written before the step reads the table: the cached prefixes of the requests the step admits
(`PrefixCache.take_writes`), carried in this copy because an upload of their own costs a loaded
server's engine thread several GIL-releasing torch calls (a short prompt cached whole, ~45 entries,
did not fit in a small bucket's T). Only the first `num_writes` go to the table; the graph sends
the rest, stale entries of earlier steps that the copy leaves in place, to the spare row's column 0
(slot 0), as padding tokens go.
`sample_tokens[:k]` are the flat indices of the k sampling requests' last tokens (a prompt chunk
that is not the last does not sample), `sample_rows[:k]` their table rows.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..pinned import PinnedStaging

# table entries a bucket carries per request beyond its T (a cached prefix is this long or shorter
# in most structured-output traffic: a chat template's start, a short prompt repeated)
WRITES_PER_REQUEST = 256


class PrefillIO:
    """Static buffers and the captured work of the prefill bucket of `tokens` tokens over
    `requests` requests. `logits_out` [>= requests, V] float32 and `rows_out` [>= requests] int64
    (the sampling requests' table rows, pad rows past them) are shared by every bucket: the prefill
    sample tail reads them whichever bucket ran."""

    def __init__(self, runner, tokens: int, requests: int, logits_out: torch.Tensor, rows_out: torch.Tensor):
        self.r = runner
        self.tokens = T = tokens
        self.requests = R = requests
        self._logits_out = logits_out[:R]
        self._rows_out = rows_out[:R]
        self.writes = W = T + WRITES_PER_REQUEST * R
        self._head = 4 * T + 6 * R + 2  # the fields before `writes`, num_writes last
        size = self._head + 2 * W
        self._staging = PinnedStaging((size,), torch.int64)
        self._dev = torch.zeros(size, dtype=torch.int64, device=runner.device)
        self._ids, self._positions, self._slots, self._table_rows = self._dev[:4 * T].view(4, T)
        rest = self._dev[4 * T:self._head]
        self._rows, self._q_starts = rest[:R], rest[R:2 * R + 1]
        self._q_lens, self._kv_lens, self._sample_tokens, self._sample_rows = rest[2 * R + 1:6 * R + 1].view(4, R)
        self._num_writes = rest[6 * R + 1:]
        self._writes = self._dev[self._head:].view(W, 2)
        self._write_index = torch.arange(W, dtype=torch.int64, device=runner.device)
        self._staged = size  # elements `copy_inputs` sends: the head and the writes staged
        self.set_inputs(np.array([runner.pad_row]), np.zeros(1, np.int64), np.zeros(1, np.int64),
                        np.zeros(1, np.int64), np.array([runner.pad_row]), np.ones(1, np.int64),
                        np.ones(1, np.int64), [0])
        self.copy_inputs()

    def fits(self, num_tokens: int, num_requests: int) -> bool:
        return num_tokens <= self.tokens and num_requests <= self.requests

    def carries(self, table_writes: tuple[np.ndarray, np.ndarray] | None) -> bool:
        """Whether `set_inputs` can take these extra table entries (at most `writes` of them)."""
        return table_writes is None or len(table_writes[0]) <= self.writes

    def set_inputs(self, rows: np.ndarray, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                   token_rows: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                   sample_index: list[int], table_writes: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Stages one prefill: B requests (`rows`, `q_lens`, `kv_lens` [B]) with n new tokens in all
        (`ids`, `positions`, `slots`, `token_rows` [n], request by request); the requests at
        `sample_index` sample from their last token. `table_writes` (flat table indices, slots;
        see `carries`) go into the table first."""
        T, R, n, B = self.tokens, self.requests, len(ids), len(rows)
        h = self._staging.stage()
        fields = h[:4 * T].reshape(4, T)
        fields[0, :n], fields[1, :n], fields[2, :n], fields[3, :n] = ids, positions, slots, token_rows
        fields[:3, n:] = 0
        fields[3, n:] = self.r.pad_row
        w = 0 if table_writes is None else len(table_writes[0])
        h[self._head - 1] = w
        if w:
            writes = h[self._head:self._head + 2 * w].reshape(w, 2)
            writes[:, 0], writes[:, 1] = table_writes
        self._staged = self._head + 2 * w
        rest = h[4 * T:self._head]
        req_rows, q_starts = rest[:R], rest[R:2 * R + 1]
        q_lens_h, kv_lens_h, sample_tokens, sample_rows = rest[2 * R + 1:6 * R + 1].reshape(4, R)
        req_rows[:B], req_rows[B:] = rows, self.r.pad_row
        q_starts[0] = 0
        np.cumsum(q_lens, out=q_starts[1:B + 1])
        q_starts[B + 1:] = n
        q_lens_h[:B], q_lens_h[B:] = q_lens, 0
        kv_lens_h[:B], kv_lens_h[B:] = kv_lens, 0
        k = len(sample_index)
        sample_tokens[:k] = q_starts[1:B + 1][sample_index] - 1
        sample_rows[:k] = rows[sample_index]
        sample_tokens[k:] = 0
        sample_rows[k:] = self.r.pad_row

    def copy_inputs(self) -> None:
        """Sends what `set_inputs` staged (a pinned buffer; the next call stages in the other)."""
        self._staging.copy_to(self._dev[:self._staged], rows=self._staged)

    def write_table(self) -> None:
        """The step's table entries: the carried writes (the first `num_writes`; the rest to the
        spare row's column 0), then the new tokens' slots."""
        r = self.r
        live = self._write_index < self._num_writes
        flat = torch.where(live, self._writes[:, 0], r.pad_row * r.table.max_context)
        r.table.write_device_flat(flat, torch.where(live, self._writes[:, 1], 0))
        r.table.write_device(self._table_rows, self._positions, self._slots)

    def forward(self) -> torch.Tensor:
        """Logits [R, V] float32 of the sampling requests' last tokens (rows past them: garbage),
        and their table rows into `rows_out`."""
        r = self.r
        self.write_table()
        meta = AttentionMetadata(
            mode=ForwardMode.EXTEND, out_slots=self._slots, q_starts=self._q_starts.to(torch.int32),
            q_lens=self._q_lens.to(torch.int32), kv_lens=self._kv_lens.to(torch.int32),
            slot_table=r.table.device_table[self._rows], max_q_len=self.tokens, max_kv_len=r.max_context)
        hidden = r.run_model(self._ids, self._positions, meta)
        logits = r.model.compute_logits(hidden.index_select(0, self._sample_tokens))
        self._logits_out.copy_(logits)
        self._rows_out.copy_(self._sample_rows)
        return self._logits_out
