"""CUDA-graph capture and replay of the model forward for a ladder of batch sizes.

One runner, parameterized by mode: each (mode, batch size, tokens per sequence) gets one graph
over static input buffers. DECODE uses one token per sequence; a speculative VERIFY uses a fixed
number of draft nodes per sequence. Batches are padded up to the next captured size; padding rows
write their K/V to the reserved slot 0 and attend to it alone, so they never touch live data.
Attention inside a graph must not depend on host values that change per step, which is why
graphs need a backend whose launch grid depends only on static shapes (triton).
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from ..attention import AttentionMetadata, ForwardMode

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class CudaGraphRunner:
    def __init__(self, model, kv, backend, max_context: int, device, max_batch: int,
                 batch_sizes=DEFAULT_BATCH_SIZES):
        self.model, self.kv, self.backend = model, kv, backend
        self.device = device
        self.max_context = max_context
        self.batch_sizes = [b for b in batch_sizes if b <= max_batch] or [max_batch]
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # tokens per sequence -> static inputs

    def padded_size(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def _static(self, q_len: int) -> dict[str, torch.Tensor]:
        if q_len not in self.buffers:
            B = self.batch_sizes[-1]
            z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=self.device)
            self.buffers[q_len] = dict(
                input_ids=z(B * q_len), positions=z(B * q_len), out_slots=z(B * q_len),
                kv_lens=torch.ones(B, dtype=torch.int32, device=self.device), slot_table=z(B, self.max_context),
                tree_mask=torch.ones(B, q_len, q_len, dtype=torch.bool, device=self.device),
            )
        return self.buffers[q_len]

    def _meta(self, mode: ForwardMode, bs: int, q_len: int) -> AttentionMetadata:
        s = self._static(q_len)
        q_lens = torch.full((bs,), q_len, dtype=torch.int32, device=self.device)
        q_starts = torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            mode=mode, out_slots=s["out_slots"][:bs * q_len], q_starts=q_starts, q_lens=q_lens,
            kv_lens=s["kv_lens"][:bs], slot_table=s["slot_table"][:bs], max_q_len=q_len,
            max_kv_len=self.max_context, tree_mask=s["tree_mask"][:bs] if mode is ForwardMode.VERIFY else None)

    @torch.inference_mode()
    def capture(self, mode: ForwardMode = ForwardMode.DECODE, q_len: int = 1, max_batch: int | None = None) -> None:
        t0 = time.perf_counter()
        s = self._static(q_len)
        sizes = [b for b in self.batch_sizes if max_batch is None or b <= max_batch]
        for bs in reversed(sizes):
            meta = self._meta(mode, bs, q_len)
            n = bs * q_len

            def step():  # logits at every token: one per sequence (decode) or per draft node (verify)
                hidden = self.model(s["input_ids"][:n], s["positions"][:n], self.kv, meta, self.backend)
                return self.model.compute_logits(hidden).float()

            for _ in range(2):  # warm up (Triton autotune/compile) outside the capture
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(mode, bs, q_len)] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs for %s x%d (batch sizes %s) in %.1f s", len(sizes), mode.value, q_len,
                 sizes, time.perf_counter() - t0)

    def can_run(self, mode: ForwardMode, batch: int, q_len: int = 1) -> bool:
        bs = self.padded_size(batch)
        return bs is not None and (mode, bs, q_len) in self.graphs

    def replay(self, mode: ForwardMode, batch: int, input_ids: torch.Tensor, positions: torch.Tensor,
               out_slots: torch.Tensor, kv_lens: torch.Tensor, slot_table: torch.Tensor,
               tree_mask: torch.Tensor | None = None, q_len: int = 1) -> torch.Tensor:
        """Inputs are for `batch` real sequences; returns logits [batch * q_len, V] (a view of a
        static buffer: read or copy it before the next replay)."""
        bs = self.padded_size(batch)
        s = self._static(q_len)
        n, pad = batch * q_len, (bs - batch) * q_len
        s["input_ids"][:n].copy_(input_ids)
        s["positions"][:n].copy_(positions)
        s["out_slots"][:n].copy_(out_slots)
        s["kv_lens"][:batch].copy_(kv_lens)
        s["slot_table"][:batch].copy_(slot_table)
        if pad:  # padding rows: slot 0, context of one token
            s["out_slots"][n:n + pad].zero_()
            s["positions"][n:n + pad].zero_()
            s["kv_lens"][batch:bs].fill_(q_len)
        if tree_mask is not None:
            s["tree_mask"][:batch].copy_(tree_mask)
        graph, out = self.graphs[(mode, bs, q_len)]
        graph.replay()
        return out[:n]
