"""CUDA-graph capture and replay for a ladder of batch sizes: one runner, parameterized by mode.

Graphs exist for
- the DECODE forward: one H2D copy of a small metadata block (rows, positions, slots, lengths),
  then one replay that also gathers the input tokens from the device-side `last_token` buffer,
  records the new slots in the request→slot table and gathers each row's slot list;
- the decode SAMPLE tail, per (masked, greedy): copies the grammar bitmask from its pinned host
  buffer, masks, samples, writes `last_token` and copies the tokens to a pinned host buffer — so a
  constrained step replays too, and a decode step costs two graph launches and two small copies;
- the speculative VERIFY step at a fixed tree width, in three parts (forward; bitmask + argmax
  tail; commit of the accepted path), whose buffers and code live in `speculative/verify_step.py`;
- the EXTEND forward (prefill) of up to R requests and T new tokens, per bucket (T, R), up to the
  sampling requests' logits (buffers and code in `prefill_graph.py`), and its SAMPLE tail, the
  decode tail's code over the prefill graphs' shared logits and rows: every step that admits a
  request samples its first token, and eagerly that took ~0.9 ms of the engine thread a step on
  the H100 (kernel launches and per-step pinned parameter tensors);
- the EAGLE DRAFT work: its start (head extend and depth 1) and one depth of the tree (buffers and
  code in `speculative/eagle_step.py`);
- for top-1 EAGLE chains, a fourth part of the verify step: its tail, acceptance and the next
  chain's whole draft in one graph (`speculative/chain_step.py`, "naive EAGLE").
Batches are padded up to the next captured size. Padding rows use a spare table row, write their
K/V to the reserved slot 0 and attend to it alone, so they never touch live data. Attention inside
a graph must not depend on host values that change per step (the triton backend's contract).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..pinned import PinnedStaging
from .prefill_graph import PrefillIO
from ..kernels import mask_logits
from .sampler import SamplingBatch, sample
from ..speculative.chain_step import ChainIO
from ..speculative.verify_step import VerifyIO

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Prefill graph buckets: new tokens (capped at max_prefill_tokens) and requests (capped at the
# running requests; a bucket holds at most as many requests as tokens).
DEFAULT_PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_PREFILL_REQUESTS = (1, 8, 32, 128)


@dataclass
class GraphStep:
    """A launched decode forward: its logits live in the graph's static buffer."""
    batch_size: int
    padded: int
    logits: torch.Tensor  # [batch_size, V] view
    rows: torch.Tensor  # [batch_size] device view
    graphs: "CudaGraphRunner"  # the runner that launched it (its sample tail replays there)
    source: str = "decode"  # the forward whose logits and rows the sample tail reads: decode or prefill


class CudaGraphRunner:
    def __init__(self, runner, batch_sizes=DEFAULT_BATCH_SIZES):
        self.r = runner
        self.device = runner.device
        self.max_context = runner.max_context
        self.batch_sizes = [b for b in batch_sizes if b <= runner.max_rows] or [runner.max_rows]
        B = self.batch_sizes[-1]
        dev = self.device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.meta = torch.zeros(B, 4, dtype=torch.int64, device=dev)  # rows, positions, out_slots, kv_lens
        self.q_starts = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.q_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.bitmask = torch.zeros(B, runner.bitmask_width, dtype=torch.int32, device=dev)
        self.params_f = torch.zeros(B, 4, dtype=torch.float32, device=dev)  # temperature, top_p, min_p, top_k
        self.params_i = torch.zeros(B, 2, dtype=torch.int64, device=dev)  # seeds, steps
        self.tokens_host = torch.zeros(B, dtype=torch.int64, pin_memory=True)
        # per-step inputs go up from pinned staging buffers reused in turn (no pinned block per step)
        self._meta_staging = PinnedStaging((B, 4), torch.int64)
        self._params_staging = (PinnedStaging((B, 4), torch.float32), PinnedStaging((B, 2), torch.int64))
        self.verify_io: dict[int, VerifyIO] = {}  # tree width -> the verify graphs' static buffers
        self.chain_io: dict[int, ChainIO] = {}  # chain width -> the fused chain graphs' buffers
        self.prefill_io: list[PrefillIO] = []  # the prefill graphs' buffers, smallest bucket first
        self.prefill_sample_sizes: list[int] = []  # batch sizes of the prefill sample tails

    def padded_size(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    # -- capture ---------------------------------------------------------------------------------
    def _capture(self, key: tuple, fn, before=None) -> torch.Tensor:
        """`before`: resets state that `fn` advances (run before each warm-up and the capture)."""
        for _ in range(2):  # warm up (Triton compiles, cuBLAS picks algorithms) outside the capture
            if before is not None:
                before()
            fn()
        if before is not None:
            before()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)
        return out

    @torch.inference_mode()
    def capture_decode(self, bitmask_host: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        pad = self.r.pad_row
        self.meta[:, 0].fill_(pad)
        self.meta[:, 3].fill_(1)
        for bs in reversed(self.batch_sizes):
            self._capture(("decode", bs), lambda bs=bs: self._decode_forward(bs))
            for masked in (False, True):
                if masked and bitmask_host is None:
                    continue
                for greedy in (True, False):
                    self._capture(("sample", "decode", bs, masked, greedy),
                                  lambda bs=bs, m=masked, g=greedy: self._sample("decode", bs, m, g, bitmask_host))
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.batch_sizes, time.perf_counter() - t0)

    def _decode_forward(self, bs: int) -> torch.Tensor:
        r = self.r
        rows, positions, out_slots, kv_lens = self.meta[:bs].t()
        r.table.write_device(rows, positions, out_slots)
        meta = AttentionMetadata(
            mode=ForwardMode.DECODE, out_slots=out_slots, q_starts=self.q_starts[:bs + 1], q_lens=self.q_lens[:bs],
            kv_lens=kv_lens.to(torch.int32), slot_table=r.table.device_table[rows], max_q_len=1,
            max_kv_len=self.max_context)
        hidden = r.run_model(r.last_token[rows], positions, meta)
        return r.model.compute_logits(hidden).float()

    def _sample(self, source: str, bs: int, masked: bool, greedy: bool, bitmask_host) -> torch.Tensor:
        """The sample tail over the logits and table rows of a decode forward of batch `bs`, or of
        any prefill bucket (`source` "prefill": their shared buffers, first `bs` rows)."""
        if source == "decode":
            logits, rows = self.graphs[("decode", bs)][1], self.meta[:bs, 0]
        else:
            logits, rows = self.prefill_logits[:bs], self.prefill_rows[:bs]
        if masked:
            self.bitmask[:bs].copy_(bitmask_host[:bs], non_blocking=True)
            logits = mask_logits(logits, self.bitmask[:bs])
        if greedy:
            tokens = logits.argmax(-1)
        else:
            f, i = self.params_f[:bs].t(), self.params_i[:bs].t()
            sb = SamplingBatch(temperature=f[0], top_p=f[1], min_p=f[2], top_k=f[3].long(), seeds=i[0], steps=i[1],
                               needs_filter=True)
            tokens = sample(logits, sb)
        self.r.last_token[rows] = tokens
        self.tokens_host[:bs].copy_(tokens, non_blocking=True)
        return tokens

    @torch.inference_mode()
    def capture_verify(self, q_len: int, max_batch: int) -> None:
        """Verify graphs at tree width `q_len` for the ladder's sizes up to `max_batch`: per size the
        forward, the tail (masked or not) and the commit of `verify_step.VerifyIO`, whose static
        buffers they read and write."""
        t0 = time.perf_counter()
        sizes = [b for b in self.batch_sizes if b <= max_batch]
        io = self.verify_io[q_len] = VerifyIO(self.r, q_len, capacity=min(max_batch, self.r.max_rows))
        for bs in reversed(sizes):
            logits = self._capture(("verify", "forward", bs, q_len), lambda bs=bs: io.forward(bs))
            for masked in (False, True):
                self._capture(("verify", "tail", bs, q_len, masked),
                              lambda bs=bs, m=masked, x=logits: io.tail(x, bs, m))
            self._capture(("verify", "commit", bs, q_len), lambda bs=bs: io.commit(bs))
        torch.cuda.synchronize()
        log.info("captured verify CUDA graphs (width %d, batch sizes %s) in %.1f s", q_len, sizes,
                 time.perf_counter() - t0)

    @torch.inference_mode()
    def capture_draft(self, drafter, max_batch: int) -> None:
        """The EAGLE draft work (`speculative/eagle_step.DraftIO`) per batch size up to `max_batch`:
        its start (the head over up to `width` unseen positions per request, then depth 1, with and
        without the roots' grammar masks) and its step (one depth, unmasked, and masked when the
        drafter masks depths past the first; the depth is a device counter, so one graph serves
        every depth). Drafters without device steps have no `io`:
        nothing to capture. A capture that fails leaves the drafter eager (logged), since drafting
        is an optimization of its own."""
        io = getattr(drafter, "io", None)
        if io is None:
            return
        t0 = time.perf_counter()
        sizes = [b for b in self.batch_sizes if b <= min(max_batch, io.capacity)]
        try:
            for bs in reversed(sizes):
                for masked in (False, True):
                    self._capture(("draft", "start", bs, masked), lambda bs=bs, m=masked: io.start(bs, m))
                    if masked and not io.masked_steps:
                        continue
                    self._capture(("draft", "step", bs, masked), lambda bs=bs, m=masked: io.step(bs, m),
                                  before=lambda: io.t.fill_(1))
        except Exception:
            log.exception("capturing the EAGLE draft step failed; it runs eagerly")
            for key in [k for k in self.graphs if k[0] == "draft"]:
                del self.graphs[key]
            return
        try:  # the one eager part of drafting: its shapes met once here, not on a loaded engine thread
            warmed = len(io.warm_catch_up())
        except Exception:
            log.exception("warming the EAGLE catch-up failed; its first catch-ups may stall")
            warmed = 0
        torch.cuda.synchronize()
        log.info("captured EAGLE draft CUDA graphs (batch sizes %s) and warmed its catch-up (%d sizes) in %.1f s",
                 sizes, warmed, time.perf_counter() - t0)

    @torch.inference_mode()
    def capture_chain(self, drafter, q_len: int, max_batch: int) -> None:
        """The fused chain step (`speculative/chain_step.ChainIO`: the verify tail, the acceptance
        and the next chain's draft) per batch size up to `max_batch`, masked and not, after the verify
        forward graph of width `q_len` whose logits it reads. Only for drafters that fuse their
        chains (`Drafter.fuses_chains`). A capture that fails leaves the step eager (logged)."""
        if not getattr(drafter, "fuses_chains", False) or q_len not in self.verify_io:
            return
        t0 = time.perf_counter()
        io = self.chain_io[q_len] = ChainIO(self.verify_io[q_len], drafter.io)
        sizes = [b for b in self.batch_sizes if b <= min(max_batch, io.capacity)]
        try:
            for bs in reversed(sizes):
                logits = self.graphs[("verify", "forward", bs, q_len)][1]
                for masked in (False, True):
                    self._capture(("verify", "chain", bs, q_len, masked),
                                  lambda bs=bs, m=masked, x=logits: io.tail_and_draft(x, bs, m))
        except Exception:
            log.exception("capturing the fused chain step failed; it runs eagerly")
            for key in [k for k in self.graphs if k[:2] == ("verify", "chain")]:
                del self.graphs[key]
            return
        torch.cuda.synchronize()
        log.info("captured fused chain CUDA graphs (width %d, batch sizes %s) in %.1f s", q_len, sizes,
                 time.perf_counter() - t0)

    def can_chain(self, batch: int, q_len: int) -> bool:
        bs = self.padded_size(batch)
        return bs is not None and ("verify", "chain", bs, q_len, False) in self.graphs

    def can_draft(self, batch: int) -> bool:
        bs = self.padded_size(batch)
        return bs is not None and ("draft", "step", bs, False) in self.graphs

    def replay_draft(self, part: str, bs: int, masked: bool) -> None:
        """Replays the draft step's `part`: "start" (the head over the unseen positions, depth 1)
        or "step" (one depth), `masked` by the grammar rows the host staged or not."""
        self.graphs[("draft", part, bs, masked)][0].replay()

    @torch.inference_mode()
    def capture_prefill(self, max_tokens: int, bitmask_host: torch.Tensor | None,
                        token_buckets=DEFAULT_PREFILL_TOKENS, request_buckets=DEFAULT_PREFILL_REQUESTS) -> None:
        t0 = time.perf_counter()
        tokens = [t for t in token_buckets if t <= max_tokens]
        # the largest bucket is the running requests' cap where that is smaller
        cap = self.r.max_rows
        requests = sorted({n for n in request_buckets if n <= cap} | {min(cap, max(request_buckets))})
        buckets = sorted(((t, n) for t in tokens for n in requests if n <= t), key=lambda b: (b[1], b[0]))
        R = max(requests)
        # every bucket leaves its sampling requests' logits and table rows here, for the sample tail
        self.prefill_logits = torch.zeros(R, self.r.vocab_size, dtype=torch.float32, device=self.device)
        self.prefill_rows = torch.full((R,), self.r.pad_row, dtype=torch.int64, device=self.device)
        self.prefill_io = [PrefillIO(self.r, t, n, self.prefill_logits, self.prefill_rows) for t, n in buckets]
        for io in reversed(self.prefill_io):
            self._capture(("prefill", io.tokens, io.requests), io.forward)
        self.prefill_sample_sizes = [b for b in self.batch_sizes if b <= R]
        self.prefill_rows.fill_(self.r.pad_row)  # the captures' warm-ups wrote the pad requests' rows
        for bs in reversed(self.prefill_sample_sizes):
            for masked in ((False, True) if bitmask_host is not None else (False,)):
                for greedy in (True, False):
                    self._capture(("sample", "prefill", bs, masked, greedy),
                                  lambda bs=bs, m=masked, g=greedy: self._sample("prefill", bs, m, g, bitmask_host))
        torch.cuda.synchronize()
        log.info("captured prefill CUDA graphs for (new tokens, requests) %s in %.1f s", buckets,
                 time.perf_counter() - t0)

    @property
    def prefill_buckets(self) -> list[tuple[int, int]]:
        """(new tokens, requests) of the prefill graphs, smallest first."""
        return [(io.tokens, io.requests) for io in self.prefill_io]

    # -- replay ----------------------------------------------------------------------------------
    def can_decode(self, batch: int) -> bool:
        bs = self.padded_size(batch)
        return bs is not None and ("decode", bs) in self.graphs

    def launch_decode(self, rows: np.ndarray, positions: np.ndarray, out_slots: np.ndarray,
                      kv_lens: np.ndarray) -> GraphStep:
        B = len(rows)
        bs = self.padded_size(B)
        host = self._meta_staging.stage()[:bs]
        host[B:] = (self.r.pad_row, 0, 0, 1)
        host[:B, 0], host[:B, 1], host[:B, 2], host[:B, 3] = rows, positions, out_slots, kv_lens
        self._meta_staging.copy_to(self.meta[:bs], bs)
        graph, logits = self.graphs[("decode", bs)]
        graph.replay()
        return GraphStep(B, bs, logits[:B], self.meta[:B, 0], self)

    def can_sample(self, step: GraphStep, masked: bool, greedy: bool) -> bool:
        return step.padded is not None and ("sample", step.source, step.padded, masked, greedy) in self.graphs

    def launch_sample(self, step: GraphStep, masked: bool, greedy: bool, params: tuple | None) -> torch.Tensor:
        """Replays the sample tail; the tokens land in `tokens_host[:batch]` (pinned)."""
        if params is not None:
            B = step.batch_size
            for values, staging, dst in zip(params, self._params_staging, (self.params_f, self.params_i)):
                staging.stage()[:B] = values  # [B, 4] float32, [B, 2] int64
                staging.copy_to(dst[:B], B)
        self.graphs[("sample", step.source, step.padded, masked, greedy)][0].replay()
        return self.tokens_host[:step.batch_size]

    def launch_prefill(self, rows: np.ndarray, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       token_rows: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                       sample_index: list[int], table_writes=None, upload_writes=None) -> GraphStep | None:
        """Replays the prefill graph of the smallest bucket that holds the requests and their new
        tokens (`PrefillIO.set_inputs` says what the arguments are). Returns the step of the k
        requests at `sample_index` (their logits [k, V] and table rows [k] on the device; its
        sample tail replays where a graph of k's padded size is captured), or None when no bucket
        is large enough (`table_writes` then untouched). Table writes more than the bucket carries
        (`PrefillIO.writes`) go through `upload_writes` first."""
        io = next((io for io in self.prefill_io if io.fits(len(ids), len(rows))), None)
        if io is None:
            return None
        if not io.carries(table_writes):
            upload_writes(table_writes)
            table_writes = None
        io.set_inputs(rows, ids, positions, slots, token_rows, q_lens, kv_lens, sample_index, table_writes)
        io.copy_inputs()
        self.graphs[("prefill", io.tokens, io.requests)][0].replay()
        k = len(sample_index)
        i = bisect.bisect_left(self.prefill_sample_sizes, k)
        padded = self.prefill_sample_sizes[i] if i < len(self.prefill_sample_sizes) else None
        if not k or padded is None or padded > io.requests:
            padded = None  # nothing to sample, or rows past this bucket's would be another step's: eager
        return GraphStep(k, padded, self.prefill_logits[:k], self.prefill_rows[:k], self, "prefill")

    def can_verify(self, batch: int, q_len: int) -> bool:
        bs = self.padded_size(batch)
        return bs is not None and ("verify", "forward", bs, q_len) in self.graphs

    def replay_verify(self, batch: int, q_len: int, part: str, masked: bool = False) -> torch.Tensor | None:
        """Replays one part ("forward", "tail", "chain" or "commit") of the verify step for `batch`
        requests, padded to the captured size; the inputs are whatever `verify_io[q_len]` (and for
        "chain" `chain_io[q_len]`) holds. Returns the part's static output (the logits for forward
        and tail)."""
        key = ("verify", part, self.padded_size(batch), q_len) + ((masked,) if part in ("tail", "chain") else ())
        graph, out = self.graphs[key]
        graph.replay()
        return out
