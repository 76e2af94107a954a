"""The device side of a speculative step: static host and device buffers, and the device work, the
same code run eagerly (CPU, or CUDA without graphs) or captured as CUDA graphs per batch size
(`CudaGraphRunner.capture_verify`).

A step is three device launches, one graph replay each on CUDA, separated by host work:
  forward  one host-to-device copy of the packed per-step inputs (table rows, context lengths,
           node tokens, depths, slots, tree mask), the new nodes' slots into the device slot
           table, the gather of the rows' slot lists, the model over B*N nodes, float32 logits;
  tail     one copy of the grammar bitmask rows (the host fills them while `forward` runs),
           masking, the argmax at every node and its copy into a pinned host buffer: all that a
           greedy step reads back;
  commit   one copy of a small block, then `last_token[row] = bonus` (the next plain decode step
           reads it) and the accepted nodes' slots moved to consecutive table columns.
Every tensor handed to the model or the kernels is contiguous (a kernel that ignores strides
silently reads the wrong elements of a strided view). Rows [B, bs) of a padded batch work on the
spare table row and slot 0, as in the decode graphs.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..pinned import PinnedBlock
from ..kernels import mask_logits
from .tree import HostTrees


class VerifyIO:
    """Buffers of the verify step at tree width N for up to `capacity` requests.

    Host side (numpy views of pinned memory on CUDA), written by the speculative worker:
      rows, base [cap]; tokens, depth, slots [cap, N]; tree_mask [cap, N, N]  (one byte buffer)
      bitmask [cap, N, W] int32
      commit_rows, commit_bonus [cap]; moved_index, moved_slots [cap * N]
    and read after the step's sync: target [cap, N] int64, the masked argmax per node.
    On the CPU the "device" buffers are the host buffers themselves.
    """

    def __init__(self, runner, width: int, capacity: int):
        self.r = runner
        self.width = N = width
        self.capacity = C = capacity
        self.device = runner.device
        pinned = self.device.type == "cuda"
        self.pad_row = runner.pad_row
        self.pad_index = runner.pad_row * runner.table.max_context  # flat table index of (pad row, column 0)

        # per-step inputs, one copy; the bitmask rows (the host fills them while `forward` runs); the
        # per-node argmax read back; after acceptance: rows and bonus tokens, moved table entries
        # (flat index, slot)
        self._inputs = PinnedBlock({"rows": ((C,), np.int64), "base": ((C,), np.int64),
                                    "tokens": ((C, N), np.int64), "depth": ((C, N), np.int64),
                                    "slots": ((C, N), np.int64), "tree_mask": ((C, N, N), np.bool_)}, self.device)
        self.rows, self.base, self.tokens, self.depth, self.slots, self.tree_mask = self._inputs.host.values()
        self._rows, self._base, tokens, depth, slots, self._tree_mask = self._inputs.device.values()
        self._tokens, self._depth, self._slots = tokens.view(-1), depth.view(-1), slots.view(-1)
        width_words = runner.bitmask_width
        self._bitmask_block = PinnedBlock({"bitmask": ((C * N, width_words), np.int32)}, self.device)
        self._bitmask_block.host["bitmask"].fill(-1)
        self.bitmask_rows = self._bitmask_block.host_tensor["bitmask"]
        self.bitmask = self._bitmask_block.host["bitmask"].reshape(C, N, width_words)
        self._bitmask = self._bitmask_block.device["bitmask"]
        self._row_bytes = 4 * width_words
        self.target_device = torch.zeros(C * N, dtype=torch.int64, device=self.device)  # the tail's argmax
        self._target = torch.zeros(C * N, dtype=torch.int64, pin_memory=pinned)  # its copy on the host
        self.target = self._target.numpy().reshape(C, N)
        self._commit = PinnedBlock({"rows": ((C,), np.int64), "bonus": ((C,), np.int64),
                                    "index": ((C * N,), np.int64), "slots": ((C * N,), np.int64)}, self.device)
        self.commit_rows, self.commit_bonus, self.moved_index, self.moved_slots = self._commit.host.values()
        self._c_rows, self._c_bonus, self._c_index, self._c_slots = self._commit.device.values()

        dev = self.device
        self._node_index = torch.arange(N, dtype=torch.int64, device=dev)
        self._q_starts = torch.arange(0, (C + 1) * N, N, dtype=torch.int32, device=dev)
        self._q_lens = torch.full((C,), N, dtype=torch.int32, device=dev)
        self._eye = np.eye(N, dtype=bool)
        # Start in the padding state: graph warm-ups and captures touch only the spare row and slot 0.
        self._pad_inputs(0, C)
        none = np.empty(0, np.int64)
        self.set_commit(C, none, none, none, none)

    # -- host side --------------------------------------------------------------------------------
    def set_inputs(self, size: int, rows: np.ndarray, base: np.ndarray, trees: HostTrees, slots: np.ndarray) -> None:
        """Writes one row per request (table row, cached context length, its tree and the tree's
        slots [N]), then padding rows up to `size`."""
        b = len(rows)
        self.rows[:b], self.base[:b] = rows, base
        self.tokens[:b], self.depth[:b], self.slots[:b] = trees.tokens, trees.depth, slots
        self.tree_mask[:b] = trees.mask
        self._pad_inputs(b, size)

    def _pad_inputs(self, start: int, stop: int) -> None:
        """Padding rows: the spare table row, a context of just their own tree, every node writing
        its K/V to slot 0 and seeing only itself."""
        if stop <= start:
            return
        self.rows[start:stop] = self.pad_row
        self.base[start:stop] = 0
        self.tokens[start:stop] = 0
        self.depth[start:stop] = 0
        self.slots[start:stop] = 0
        self.tree_mask[start:stop] = self._eye

    def set_commit(self, size: int, rows, bonus, moved_index, moved_slots) -> None:
        """The next plain step's input token per row, and the table entries (flat index into the
        [rows, max_context] table, slot) the accepted path moves; padding up to `size` rows."""
        b, m = len(rows), len(moved_index)
        self.commit_rows[:b], self.commit_bonus[:b] = rows, bonus
        self.commit_rows[b:size], self.commit_bonus[b:size] = self.pad_row, 0
        self.moved_index[:m], self.moved_slots[:m] = moved_index, moved_slots
        self.moved_index[m:size * self.width], self.moved_slots[m:size * self.width] = self.pad_index, 0

    # -- device side (captured per batch size on CUDA) -----------------------------------------------
    def forward(self, bs: int, max_kv: int | None = None) -> torch.Tensor:
        """Logits [bs*N, V] float32. `max_kv` (eager CPU only) narrows the slot table to the longest
        context; graphs and eager CUDA read the full width."""
        r, N = self.r, self.width
        self._inputs.upload()
        n = bs * N
        rows = self._rows[:bs]
        r.table.write_device(rows[:, None].expand(bs, N).reshape(-1), self.node_columns(bs), self._slots[:n])
        positions = (self._base[:bs, None] + self._depth[:n].view(bs, N)).view(-1)  # RoPE position: base + depth
        meta = self.node_metadata(bs, ForwardMode.VERIFY, max_kv)
        hidden = r.run_model(self._tokens[:n], positions, meta)
        return r.model.compute_logits(hidden).float()

    def node_metadata(self, bs: int, mode: ForwardMode, max_kv: int | None = None) -> AttentionMetadata:
        """Attention over the staged nodes of `bs` rows: N queries per row after its cached context,
        under the tree mask (VERIFY) or causal (EXTEND: a chain's nodes, as the EAGLE head reads them
        after a verify, `chain_step.py`)."""
        N, base, rows = self.width, self._base[:bs], self._rows[:bs]
        table = self.r.table.device_table[rows] if max_kv is None else self.r.table.device_table[rows, :max_kv]
        return AttentionMetadata(
            mode=mode, out_slots=self._slots[:bs * N], q_starts=self._q_starts[:bs + 1], q_lens=self._q_lens[:bs],
            kv_lens=(base + N).to(torch.int32), slot_table=table, max_q_len=N, max_kv_len=table.shape[1],
            tree_mask=self._tree_mask[:bs] if mode == ForwardMode.VERIFY else None)

    def device_rows(self, bs: int) -> torch.Tensor:
        return self._rows[:bs]

    def device_base(self, bs: int) -> torch.Tensor:
        return self._base[:bs]

    def device_tokens(self, bs: int) -> torch.Tensor:
        return self._tokens[:bs * self.width].view(bs, self.width)

    def node_columns(self, bs: int) -> torch.Tensor:
        """[bs*N] table column of each node on the device: node i sits at base + i (for a chain,
        also its position)."""
        return (self._base[:bs, None] + self._node_index).view(-1)

    def tail(self, logits: torch.Tensor, bs: int, masked: bool) -> torch.Tensor:
        """Masks the logits with the bitmask rows (when `masked`) and copies the argmax per node to
        the pinned `target`. Returns the (masked) logits for sampled verification."""
        n = bs * self.width
        if masked:
            if self._bitmask.device.type == "cuda":
                self._bitmask_block.upload("bitmask", n * self._row_bytes)
                logits = mask_logits(logits, self._bitmask[:n])  # one Triton launch: capturable
            else:
                logits = _mask_in_place_cpu(logits, self._bitmask[:n])
        torch.argmax(logits, -1, out=self.target_device[:n])
        self._target[:n].copy_(self.target_device[:n], non_blocking=True)
        return logits

    def commit(self, bs: int) -> None:
        r = self.r
        self._commit.upload()
        r.last_token.index_copy_(0, self._c_rows[:bs], self._c_bonus[:bs])
        n = bs * self.width
        r.table.device_table.view(-1).index_copy_(0, self._c_index[:n], self._c_slots[:n])


def _mask_in_place_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return logits


class VerifyLaunch:
    """One step's device work: graph replays when a graph of this batch size was captured, else the
    same functions eagerly. `size` is the number of rows the device works on (padded for graphs)."""

    def __init__(self, io: VerifyIO, graphs, batch: int):
        self.io, self.graphs, self.batch = io, graphs, batch
        self.graphed = graphs is not None and graphs.can_verify(batch, io.width)
        self.size = graphs.padded_size(batch) if self.graphed else batch

    def forward(self, max_kv: int | None) -> torch.Tensor:
        if self.graphed:
            return self.graphs.replay_verify(self.batch, self.io.width, "forward")
        return self.io.forward(self.size, max_kv)

    def tail(self, logits: torch.Tensor, masked: bool) -> torch.Tensor:
        if self.graphed:
            return self.graphs.replay_verify(self.batch, self.io.width, "tail", masked)
        return self.io.tail(logits, self.size, masked)

    def chain(self, logits: torch.Tensor, masked: bool, chain, max_kv: int | None) -> None:
        """The fused chain step's tail, acceptance and next draft (`chain_step.ChainIO`)."""
        if self.graphed and self.graphs.can_chain(self.batch, self.io.width):
            self.graphs.replay_verify(self.batch, self.io.width, "chain", masked)
        else:
            chain.tail_and_draft(logits, self.size, masked, max_kv)

    def commit(self) -> None:
        if self.graphed:
            self.graphs.replay_verify(self.batch, self.io.width, "commit")
        else:
            self.io.commit(self.size)
