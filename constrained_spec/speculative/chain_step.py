"""Naive EAGLE: for top-1 chains, the verify step's tail and the next step's draft in one device
launch (one CUDA graph per batch size and masking, `CudaGraphRunner.capture_chain`), so that a
speculative step has one read-back and no drafting on the host.

A step of the tree path reads twice and works on the host in between: the draft (catch-up, root
mask, start, depths, read, tree selection), then the verify (forward, masks, tail, read,
acceptance). For a chain the device can accept on its own, and the head's next start needs only
what the verify just computed, so after the verify forward (the host fills the chain's grammar rows
meanwhile) one launch runs:
  tail     the grammar rows, masking, the argmax at every node (`VerifyIO.tail`);
  accept   per request, the drafted nodes whose token is the argmax at their parent, up to the
           first that is not or that the grammar pruned: cumprod over the chain;
  start    the head over every node of the chain (`DraftIO.start_after_verify`): its output at the
           last accepted node is the next root's hidden state; the next chain's first token;
  depths   the chain's other tokens, one head decode step each (`DraftIO.step`, top-1);
  read     accept lengths and the next chain into pinned memory.
The host then reads once, commits as the tree path does, and keeps each request's next chain for
the next step (`SpeculativeWorker`), which checks it with the grammar before verifying it. The
drafts are not masked while drafted (the host has not accepted the bonus into the grammar yet); the
check prunes them instead. That costs ~0.1 token a step (JSON on the H100, the shipped head: 2.00
tokens a fused step against 2.12 drafted apart with depth 1 masked), and the fused step is still
11-24% faster (docs/performance.md). Greedy batches only: sampled requests verify through
`sample_ahead` on the host's trees.
"""
from __future__ import annotations

import numpy as np
import torch

from ..pinned import PinnedBlock


class ChainIO:
    """Buffers and device work of the fused chain step over a verify step's buffers (`VerifyIO`,
    chain width N) and an EAGLE drafter's (`DraftIO`, top-1, depth D = N - 1 or less)."""

    def __init__(self, verify, draft):
        if draft.K != 1:
            raise ValueError(f"a fused chain step drafts top-1 chains, not top-{draft.K} trees")
        if draft.D >= verify.width:
            raise ValueError(f"a chain of depth {draft.D} does not fit the verify width {verify.width}")
        self.verify, self.draft = verify, draft
        self.width, self.depth = verify.width, draft.D
        C = self.capacity = min(verify.capacity, draft.capacity)
        dev = self.device = verify.device
        # live nodes per chain after the grammar's pruning (host -> device with the tail)
        self._live = PinnedBlock({"live": ((C,), np.int64)}, dev)
        self.live = self._live.host["live"]
        self.live[:] = 1
        self._live_dev = self._live.device["live"]
        self._index = torch.arange(1, self.width, device=dev)
        # what the host reads: per request the accepted drafts, then the next chain's D tokens
        self._out_device = torch.zeros(C, 1 + self.depth, dtype=torch.int64, device=dev)
        self._out = torch.zeros(C, 1 + self.depth, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.out = self._out.numpy()

    def set_live(self, size: int, live: np.ndarray) -> None:
        """Live nodes per chain (root included) for the B = len(live) requests; padding rows to `size`."""
        b = len(live)
        self.live[:b], self.live[b:size] = live, 1

    def tail_and_draft(self, logits: torch.Tensor, bs: int, masked: bool, max_kv: int | None = None) -> None:
        """The launch after the verify forward (captured per batch size and masking; `max_kv`:
        eager CPU only, the slot-table width the verify read)."""
        v, d, N = self.verify, self.draft, self.width
        v.tail(logits, bs, masked)
        self._live.upload()
        target = v.target_device[:bs * N].view(bs, N)
        accept = accept_chains(v.device_tokens(bs), target, self._live_dev[:bs], self._index)
        d.start_after_verify(bs, v, accept, max_kv)
        for _ in range(1, self.depth):
            d.step(bs, False, max_kv if max_kv is None else max_kv + self.depth)
        out = self._out_device[:bs]
        out[:, 0] = accept
        out[:, 1:] = d.out_tok[:bs, :, 0]
        self._out[:bs].copy_(out, non_blocking=True)

    def read(self, B: int) -> tuple[np.ndarray, np.ndarray]:
        """After the step's sync: accepted drafts [B] and the next chains [B, D] (host views)."""
        return self.out[:B, 0], self.out[:B, 1:]


def accept_chains(tokens: torch.Tensor, target: torch.Tensor, live: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of chains on the device: tokens, target [B, N] (node i's token; the argmax
    after node i), live [B] nodes of each chain that may be accepted (the root and the drafts the
    grammar left), index = arange(1, N). Returns the accepted drafts per request [B]."""
    match = (tokens[:, 1:] == target[:, :-1]) & (index[None, :] < live[:, None])
    return match.to(torch.int64).cumprod(1).sum(1)
