"""The device side of EAGLE drafting: static buffers and the device work of a draft step, the same
code run eagerly (CPU, CUDA without graphs) or replayed as CUDA graphs per batch size and masking
(`CudaGraphRunner.capture_draft`), like `verify_step.py` for the verify step. Three parts:

`start`: the head over each request's unseen positions (packed; in the graph, up to `width` per
request, padding requests on the spare table row and a tail that belongs to no sequence, written
to slot 0, as in the prefill graphs), its output at the last one (the root's hidden state), the
root's log-probabilities, masked by the grammar rows the host filled (a graph with and one without
the mask), and their top-k: the first frontier.

`catch_up`: the head over the positions a start cannot take (a request more than `width` positions
behind, after a prefill or plain steps), eagerly, for their K/V alone.

`step`, one depth: expanding the tree is a decode step of the head for B*K *virtual sequences*, one
per frontier node (K per request): sequence (b, j) is request b's context followed by node j's
ancestors in the tree and the node itself. Its slot-table row is request b's row with columns
n_b .. n_b + t - 1 replaced by the scratch slots of those tree nodes (depth t), so the head's
attention is the target's own decode attention (triton on CUDA, split over the context) and needs
no tree mask. Scratch slots lie past the target pool's slots in the head's one-layer KV cache: K
per depth per request. The depth is a device-side counter, so one graph serves every depth, and
nothing of the host comes between two unmasked depths:
  the frontier's scratch slots and ancestor columns into the draft table (`frontier.place_frontier`);
  the head over the frontier (input: its parent's head output and its token, position n + t - 1);
  the target's norm and LM head;
  for a masked depth (`eagle_masked_depths` > 1), the grammar rows the host filled after reading the
  frontier (`frontier_host`, a sync); the top-k children per node by path score (their
  log-probabilities plus the node's: `kernels.topk_logprobs`, two launches on CUDA); the best K of
  the K*K children become the next frontier (their tokens, scores, parents' outputs and ancestor
  slots gathered: `frontier.advance_frontier`); children and choices recorded in `out_*` for the
  host, which reads them once at the end.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..pinned import GrowingStaging, PinnedBlock
from ..kernels import topk_logprobs
from .frontier import advance_frontier, place_frontier


class DraftIO:
    """Buffers and device work of the EAGLE draft steps for up to `capacity` requests."""

    def __init__(self, runner, head, kv, topk: int, depth: int, capacity: int, width: int,
                 masked_steps: bool = False):
        self.r, self.head, self.target, self.kv = runner, head, runner.model, kv
        self.masked_steps = masked_steps  # whether a depth past the first is ever masked (its graphs)
        self.K, self.D, self.capacity = K, D, C = topk, depth, capacity
        self.width = N = width  # most unseen positions per request that the graphed start takes
        dev = self.device = runner.device
        H, W = runner.mcfg.hidden_size, runner.bitmask_width
        self.max_context = runner.table.max_context
        # per step, from the host (`set_inputs`), uploaded by `start`: table rows, cached lengths,
        # and, for the graphed start, the unseen positions packed (ids, positions, slots), their
        # sequence starts and each request's last token
        self._catch_up_inputs = GrowingStaging(dev)  # `catch_up`'s, whose count varies
        self._inputs = PinnedBlock({"rows": ((C,), np.int64), "n": ((C,), np.int64), "q_starts": ((C + 1,), np.int64),
                                    "last": ((C,), np.int64), "ids": ((C * N,), np.int64),
                                    "pos": ((C * N,), np.int64), "slots": ((C * N,), np.int64)}, dev)
        self._host, self._dev = self._inputs.host, self._inputs.device
        self._rows, self._n = self._dev["rows"], self._dev["n"]
        self._pad_inputs(0, C)
        self._n_rep = torch.zeros(C * K, dtype=torch.int64, device=dev)
        self.t = torch.ones(1, dtype=torch.int64, device=dev)  # depth of the frontier
        # the frontier
        self.front_tok = torch.zeros(C * K, dtype=torch.int64, device=dev)
        self.front_score = torch.zeros(C * K, dtype=torch.float32, device=dev)
        self.parent_hidden = torch.zeros(C * K, H, dtype=runner.dtype, device=dev)
        self.anc = torch.zeros(C * K, D, dtype=torch.int64, device=dev)  # scratch slots of ancestors + itself
        self.draft_table = torch.zeros(C * K, self.max_context, dtype=torch.int64, device=dev)
        pool = runner.kv.num_slots
        self._own_base = (pool + torch.arange(C, device=dev)[:, None] * (K * D)
                          + torch.arange(K, device=dev)[None, :]).reshape(-1)  # + (t - 1) * K
        self._own = torch.zeros(C * K, dtype=torch.int64, device=dev)  # a depth's scratch slots, lengths, positions
        self._kv_lens = torch.zeros(C * K, dtype=torch.int32, device=dev)
        self._positions = torch.zeros(C * K, dtype=torch.int64, device=dev)
        self._q_starts = torch.arange(C * K + 1, dtype=torch.int32, device=dev)
        self._q_lens = torch.ones(C * K, dtype=torch.int32, device=dev)
        # grammar rows (the host fills them, a masked start or step copies them): the roots', or
        # the frontier's for a masked depth past the first
        self._masks = PinnedBlock({"bitmask": ((C * K, W), np.int32)}, dev)
        self.bitmask_host = self._masks.host_tensor["bitmask"]
        self._bitmask = self._masks.device["bitmask"]
        self._row_bytes = W * 4
        # what the host reads: per depth, the K*K children (tokens, path scores) and the K chosen
        self.out_tok = torch.zeros(C, D, K * K, dtype=torch.int64, device=dev)
        self.out_score = torch.full((C, D, K * K), -torch.inf, dtype=torch.float32, device=dev)
        self.out_best = torch.zeros(C, D, K, dtype=torch.int64, device=dev)
        pinned = dev.type == "cuda"  # the frontier, read by the host before a masked depth
        self._f_tok = torch.zeros(C * K, dtype=torch.int64, pin_memory=pinned)
        self._f_score = torch.zeros(C * K, dtype=torch.float32, pin_memory=pinned)
        self._f_best = torch.zeros(C * K, dtype=torch.int64, pin_memory=pinned)

    # -- the start of a step: the head over the unseen positions, then depth 1 ------------------------
    def _pad_inputs(self, start: int, stop: int) -> None:
        """Requests [start, stop) as padding: the spare table row, one token at position 0 in slot 0."""
        h = self._host
        h["rows"][start:stop], h["n"][start:stop] = self.r.pad_row, 1
        if start == 0:
            h["q_starts"][0] = 0
        h["q_starts"][start + 1:stop + 1] = h["q_starts"][start] + np.arange(1, stop - start + 1)
        h["last"][start:stop] = h["q_starts"][start + 1:stop + 1] - 1
        first = int(h["q_starts"][start])
        for name in ("ids", "pos", "slots"):
            h[name][first:] = 0

    def set_inputs(self, bs: int, rows: np.ndarray, n: np.ndarray, ids: np.ndarray, pos: np.ndarray,
                   slots: np.ndarray, q_lens: np.ndarray, graphed: bool) -> dict | None:
        """Stages a step's start for B = len(rows) requests, padded to `bs` when `graphed`. Returns the
        packed token fields as device tensors for an eager start (None: the graph reads the block)."""
        B, h = len(rows), self._host
        h["rows"][:B], h["n"][:B] = rows, n
        starts = np.zeros(B + 1, np.int64)
        np.cumsum(q_lens, out=starts[1:])
        h["q_starts"][:B + 1] = starts
        h["last"][:B] = starts[1:] - 1
        if graphed:
            T = int(starts[-1])
            h["ids"][:T], h["pos"][:T], h["slots"][:T] = ids, pos, slots
            self._pad_inputs(B, bs)  # and the tail past them: in no sequence, written to slot 0
            return None
        dev = self.device
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in
                (("ids", ids), ("pos", pos), ("slots", slots), ("q_starts", starts), ("last", starts[1:] - 1))}

    def start(self, bs: int, masked: bool, eager: dict | None = None, max_q: int | None = None,
              max_kv: int | None = None) -> None:
        """The head over each request's unseen positions (writing its K/V; inputs: the target's
        features there and the next tokens), its output at the last one (the root's hidden state),
        the root's grammar-masked log-probabilities, and their top-k children as the first
        frontier. Captured per batch size and masking (`eager` None: the staged block, every
        request padded to `width` positions); eager with `eager`'s packed tensors otherwise."""
        self._inputs.upload()
        if eager is None:
            T, d = bs * self.width, self._dev
            ids, pos, slots, q_starts, last = (d["ids"][:T], d["pos"][:T], d["slots"][:T], d["q_starts"][:bs + 1],
                                               d["last"][:bs])
            max_q = self.width
        else:
            ids, pos, slots, q_starts, last = (eager[k] for k in ("ids", "pos", "slots", "q_starts", "last"))
        rows, n = self._rows[:bs], self._n[:bs]
        hidden = self._extend(rows, n, ids, pos, slots, q_starts, max_q, max_kv)
        self._first_depth(bs, rows, n, hidden.index_select(0, last), masked)

    def start_after_verify(self, bs: int, verify, accept_lens: torch.Tensor, max_kv: int | None = None) -> None:
        """The start from a verify step's chain nodes (`chain_step.py`, naive EAGLE): the head over
        every node of each request's chain in causal order (the nodes past the accepted ones write
        K/V only into slots the host frees), inputs the features the verify forward just wrote and
        the target's argmax at each node (an accepted node's next token; at the last accepted one,
        the bonus), and its output at node accept_lens[b] as the root's hidden state; then depth 1,
        unmasked (the host has not yet accepted the bonus into the grammar)."""
        N = verify.width
        meta = verify.node_metadata(bs, ForwardMode.EXTEND, max_kv)
        hidden = self.head(self.target, self.r.features.index_select(0, meta.out_slots),
                           verify.target_device[:bs * N], verify.node_columns(bs), self.kv, meta, self.r.backend)
        last = torch.arange(bs, device=self.device) * N + accept_lens
        rows = verify.device_rows(bs)
        self._first_depth(bs, rows, verify.device_base(bs) + accept_lens + 1, hidden.index_select(0, last), False)

    def _first_depth(self, bs: int, rows: torch.Tensor, n: torch.Tensor, root_hidden: torch.Tensor,
                     masked: bool) -> None:
        """Depth 1 from the roots' hidden states (requests on table `rows` with n cached positions):
        the root's log-probabilities, masked by the staged grammar rows when `masked`, their top-k
        as the first frontier."""
        K, dev = self.K, self.device
        logits = self.head.logits(self.target, root_hidden)
        score, tok = topk_logprobs(logits, K, self._uploaded_masks(bs) if masked else None)
        live = (rows != self.r.pad_row)[:, None]
        score = torch.where(live, score, -torch.inf)
        self.out_tok[:bs, 0, :K] = tok
        self.out_score[:bs, 0] = -torch.inf
        self.out_score[:bs, 0, :K] = score
        self.out_best[:bs, 0] = torch.arange(K, device=dev)
        self.front_tok[:bs * K] = tok.reshape(-1)
        self.front_score[:bs * K] = score.reshape(-1)
        self.parent_hidden[:bs * K] = root_hidden.repeat_interleave(K, 0)
        self._n_rep[:bs * K] = n.repeat_interleave(K)
        self.draft_table[:bs * K] = self.r.table.device_table[rows].repeat_interleave(K, 0)
        self.t.fill_(1)

    def catch_up(self, rows: np.ndarray, kv_lens: np.ndarray, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray,
                 q_lens: np.ndarray, max_kv: int | None = None, pad_to: int | None = None) -> None:
        """The head over packed positions (per request the `q_lens` before `kv_lens`), eagerly, for
        their K/V alone: what a request's start cannot take in the graph (`width` positions) after
        a prefill or plain steps, so that the start and every depth still replay their graphs.

        On CUDA the positions are padded to `catch_up_size` (`pad_to`) by one more sequence on the
        spare table row that writes the reserved slot 0: cuBLAS chooses each GEMM's algorithm on the
        host for every new row count, and a count that changed at every catch-up (the positions
        decoded plainly since the last draft) held the engine thread 2.3-15.7 ms a catch-up of
        300-370 positions (H200, batch 32), 2.3-2.7 ms padded (the eager launches). The inputs go
        up in one copy from pinned memory (a pageable copy waits for the stream)."""
        T = len(ids)
        if pad_to is None:
            pad_to = catch_up_size(T, self.max_context) if self.device.type == "cuda" else T
        if pad_to > T:
            P = pad_to - T
            rows, kv_lens, q_lens = (np.append(x, v) for x, v in ((rows, self.r.pad_row), (kv_lens, P), (q_lens, P)))
            ids, slots = (np.concatenate([x, np.zeros(P, np.int64)]) for x in (ids, slots))
            pos = np.concatenate([pos, np.arange(P)])
        B = len(rows)
        sizes = (B, B, B + 1, pad_to, pad_to, pad_to)
        host = self._catch_up_inputs.stage(sum(sizes))
        host[:B], host[B:2 * B], host[2 * B] = rows, kv_lens, 0
        np.cumsum(q_lens, out=host[2 * B + 1:3 * B + 1])
        at = 3 * B + 1
        for x in (ids, pos, slots):
            host[at:at + pad_to] = x
            at += pad_to
        rows_d, kv_d, starts_d, ids_d, pos_d, slots_d = self._catch_up_inputs.upload(sum(sizes)).split(sizes)
        self._extend(rows_d, kv_d, ids_d, pos_d, slots_d, starts_d, int(q_lens.max()), max_kv)

    def warm_catch_up(self) -> list[int]:
        """A catch-up of padding alone (the spare row writing slot 0) at every padded size one
        sequence holds, 64 up to max_context positions, at start-up: the first catch-up at a new
        size chooses its GEMMs' algorithms and may compile an attention variant, on the engine
        thread (0.68 s once, the first catch-up padded to 8,192 positions on the H200). Returns the
        sizes."""
        sizes, none = [], np.zeros(0, np.int64)
        size = catch_up_size(1, self.max_context)
        while size <= self.max_context:
            self.catch_up(none, none, none, none, none, none, pad_to=size)
            sizes.append(size)
            size *= 2
        return sizes

    def _extend(self, rows, kv_lens, ids, pos, slots, q_starts, max_q: int, max_kv: int | None) -> torch.Tensor:
        """The head over packed new positions of the requests on table `rows` (each sees its first
        kv_lens slots; its new positions are the last q of them); writes their K/V, returns its output."""
        table = self.r.table.device_table[rows]
        if max_kv is not None:
            table = table[:, :max_kv]
        meta = AttentionMetadata(
            mode=ForwardMode.EXTEND, out_slots=slots, q_starts=q_starts.to(torch.int32),
            q_lens=(q_starts[1:] - q_starts[:-1]).to(torch.int32), kv_lens=kv_lens.to(torch.int32),
            slot_table=table, max_q_len=max_q, max_kv_len=table.shape[1])
        return self.head(self.target, self.r.features.index_select(0, slots), ids, pos, self.kv, meta,
                         self.r.backend)

    # -- one depth (captured per batch size and masking on CUDA) -------------------------------------
    def step(self, bs: int, masked: bool = False, max_kv: int | None = None) -> None:
        K, D = self.K, self.D
        BK = bs * K
        t = self.t
        anc, own, kv_lens, positions = self.anc[:BK], self._own[:BK], self._kv_lens[:BK], self._positions[:BK]
        place_frontier(t, K, self._own_base[:BK], self._n_rep[:BK], anc, self.draft_table[:BK], own, kv_lens, positions)
        table = self.draft_table[:BK] if max_kv is None else self.draft_table[:BK, :max_kv]
        meta = AttentionMetadata(
            mode=ForwardMode.DECODE, out_slots=own, q_starts=self._q_starts[:BK + 1], q_lens=self._q_lens[:BK],
            kv_lens=kv_lens, slot_table=table, max_q_len=1, max_kv_len=table.shape[1])
        hidden = self.head(self.target, self.parent_hidden[:BK], self.front_tok[:BK], positions, self.kv, meta,
                           self.r.backend)
        logits = self.head.logits(self.target, hidden)
        child_s, child_t = topk_logprobs(logits, K, self._uploaded_masks(BK) if masked else None,
                                         base=self.front_score[:BK])  # path scores [BK, K]
        # the next frontier: the best K of each request's K*K children
        advance_frontier(K, child_s.view(bs, K * K), child_t.view(bs, K * K), hidden, t, anc, self.out_tok,
                         self.out_score, self.out_best, self.front_tok, self.front_score, self.parent_hidden)
        t.add_(1)

    def _uploaded_masks(self, rows: int) -> torch.Tensor:
        """The first `rows` grammar rows the host filled, on the device."""
        self._masks.upload("bitmask", rows * self._row_bytes)
        return self._bitmask[:rows]

    def frontier_host(self, B: int, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The frontier's tokens and path scores, and the choices that made it (each node's index
        among its depth's children), [B, K] on the host, after the step that recorded depth
        index `depth` (0: the start): three copies, one sync."""
        K = self.K
        for dst, src in ((self._f_tok, self.front_tok[:B * K]), (self._f_score, self.front_score[:B * K]),
                         (self._f_best, self.out_best[:B, depth].reshape(-1))):
            dst[:B * K].copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        view = lambda x: x[:B * K].numpy().reshape(B, K)
        return view(self._f_tok), view(self._f_score), view(self._f_best)

    def outputs_host(self, B: int, depth: int):
        """(tokens, scores [B, depth, K*K], chosen [B, depth, K]) on the host: the step's one read-back
        for requests without a grammar."""
        return (self.out_tok[:B, :depth].cpu().numpy(), self.out_score[:B, :depth].cpu().numpy(),
                self.out_best[:B, :depth].cpu().numpy())


def catch_up_size(positions: int, max_context: int) -> int:
    """The row count a catch-up of `positions` runs at on CUDA: the next power of two (at least 64),
    so that its GEMMs keep to a few shapes; unpadded where the padding would not fit one sequence of
    the spare table row (more than `max_context` positions)."""
    size = max(64, 1 << (positions - 1).bit_length())
    return size if size - positions <= max_context else positions
