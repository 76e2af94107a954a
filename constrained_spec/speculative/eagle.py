"""EAGLE drafter: a draft tree per request from the EAGLE head (`models/eagle.py`), grammar-masked
while it is drafted (EAGLE-2's dynamic tree).

Per speculative step, for the requests of the batch:
  extend  the head runs over the positions it has not seen yet (the last step's accepted tokens,
          or more after plain steps and prefills): input f_i, the target's pre-norm hidden state
          that every forward leaves at position i's KV slot (`ModelRunner.features`), and the token
          at i + 1; its K/V go to the same slot of the head's own one-layer KV cache, so the head
          shares the target's slot table and needs no bookkeeping of its own. Its output at the
          last position is the guess of the root's hidden state.
  expand  depth by depth: the frontier's logits (target norm + LM head) are masked by the
          request's grammar (each frontier node's path accepted into its matcher, one bitmask row
          filled, rolled back), log-softmaxed and added to the node's path score; every node gets
          its top-k children as candidates, and the k best candidates become the next frontier,
          which the head runs on (its attention: the context, and the node's ancestors in the tree,
          whose K/V sit in scratch slots past the pool's). A token the grammar forbids scores -inf
          and is never drafted; a forced token scores its parent's score, so forced runs are
          drafted whole.
  select  the N - 1 best candidates by path score (a child never outscores its parent, so the
          choice is a tree), laid out parents first in xgrammar's layout.
The worker still checks every tree with the grammar's traversal before verifying it. Drafts are
deterministic (top-k), so the worker's path-matching verification stays lossless at any temperature.
Runs eagerly (CPU, and CUDA: the draft steps are not graphed yet).
"""
from __future__ import annotations

from typing import Hashable

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, ForwardMode, KVCache
from ..attention.base import AttentionBackend
from ..kernels import mask_logits
from .drafter import DraftBatch, Drafter
from .tree import DraftTrees

__all__ = ["EagleDrafter", "TreeAttention"]


class TreeAttention(AttentionBackend):
    """The head's attention in the expand steps: every request's queries (its frontier, `max_q_len`
    nodes) see the keys at `slot_table[b]` that `tree_mask[b, i]` marks (its context and the node's
    ancestors and itself). RoPE and the K/V store as the target's backend does them."""
    name = "eagle-tree"

    def forward(self, q, k, v, layer, kv: KVCache, meta: AttentionMetadata, scale, rope=None):
        q = self.store_kv(q, k, v, layer, kv, meta, rope)
        B, Q = meta.batch_size, meta.max_q_len
        T, H, D = q.shape
        S = meta.slot_table.shape[1]
        slots = meta.slot_table.reshape(-1)
        kp = kv.k[layer].index_select(0, slots).view(B, S, -1, D).transpose(1, 2)
        vp = kv.v[layer].index_select(0, slots).view(B, S, -1, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(B, Q, H, D).transpose(1, 2), kp, vp,
                                             attn_mask=meta.tree_mask[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(T, H, D)


class EagleDrafter(Drafter):
    needs_requests = True

    def __init__(self, runner, head, num_draft_tokens: int = 8, topk: int = 4, depth: int = 6):
        if topk < 1 or depth < 1 or num_draft_tokens < 2:
            raise ValueError("EAGLE needs topk >= 1, depth >= 1 and at least 2 draft tokens")
        self.runner, self.head, self.target = runner, head, runner.model
        if runner.features is None:
            raise ValueError("the model runner keeps no hidden states (speculative_algorithm must be 'eagle')")
        self.num_draft_tokens = num_draft_tokens
        self.topk, self.depth = topk, depth
        self.device = runner.device
        cfg = runner.mcfg
        self.pool_slots = runner.kv.num_slots
        self.scratch_per_request = topk * depth
        capacity = runner.max_rows + 1
        self.kv = KVCache(1, self.pool_slots + capacity * self.scratch_per_request, cfg.num_kv_heads, cfg.head_dim,
                          runner.dtype, self.device)
        self.tree_attention = TreeAttention()
        # request id -> (row, slot of position 0, positions the head has seen, slot of the last of them)
        self._seen: dict[Hashable, tuple[int, int, int, int]] = {}

    # -- the Drafter interface -------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftTrees:
        return DraftTrees.from_arrays(*self.propose_arrays(batch))

    @torch.inference_mode()
    def propose_arrays(self, batch: DraftBatch):
        reqs = batch.requests
        if reqs is None:
            raise ValueError("the EAGLE drafter needs DraftBatch.requests")
        root_hidden, lengths = self._extend(reqs)
        return self._expand(reqs, root_hidden, lengths)

    def finish(self, request_id: Hashable) -> None:
        self._seen.pop(request_id, None)

    # -- extend: the head over the positions it has not seen ---------------------------------------
    def _extend(self, reqs) -> tuple[torch.Tensor, np.ndarray]:
        """Runs the head over each request's unseen positions; returns its output at each request's
        last cached position ([B, H]: the guess of the root's hidden state) and the cached lengths."""
        table = self.runner.table.host
        B = len(reqs)
        n = np.fromiter((r.num_cached for r in reqs), np.int64, B)
        start = np.empty(B, np.int64)
        for b, r in enumerate(reqs):
            seen = self._seen.get(r.request_id)
            d = 0
            if seen is not None:
                row, first, count, last = seen
                if row == r.row and first == table[r.row, 0] and 0 < count <= n[b] and table[r.row, count - 1] == last:
                    d = count
            start[b] = min(d, n[b] - 1)  # at least the last position: its output is the root's guess
        q_lens = n - start
        rows = np.fromiter((r.row for r in reqs), np.int64, B)
        pos = np.concatenate([np.arange(s, e) for s, e in zip(start, n)])
        owner = np.repeat(np.arange(B), q_lens)
        slots = table[rows[owner], pos]
        ids = np.concatenate([np.asarray(r.all_ids[s + 1:e + 1], np.int64) for r, s, e in zip(reqs, start, n)])
        q_starts = np.zeros(B + 1, np.int64)
        np.cumsum(q_lens, out=q_starts[1:])
        max_kv = int(n.max())
        dev = self.device
        slots_d = torch.from_numpy(slots).to(dev)
        meta = AttentionMetadata(
            mode=ForwardMode.EXTEND, out_slots=slots_d, q_starts=torch.from_numpy(q_starts).to(dev, torch.int32),
            q_lens=torch.from_numpy(q_lens).to(dev, torch.int32), kv_lens=torch.from_numpy(n).to(dev, torch.int32),
            slot_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_kv])).to(dev),
            max_q_len=int(q_lens.max()), max_kv_len=max_kv)
        features = self.runner.features.index_select(0, slots_d)
        hidden = self.head(self.target, features, torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev),
                           self.kv, meta, self.runner.backend)
        for b, r in enumerate(reqs):
            self._seen[r.request_id] = (r.row, int(table[r.row, 0]), int(n[b]), int(table[r.row, n[b] - 1]))
        last = torch.from_numpy(q_starts[1:] - 1).to(dev)
        return hidden.index_select(0, last), n

    # -- expand: the tree, depth by depth -----------------------------------------------------------
    def _expand(self, reqs, root_hidden: torch.Tensor, n: np.ndarray):
        B, K, D, N = len(reqs), self.topk, self.depth, self.num_draft_tokens
        dev, vocab = self.device, self.runner.vocab_size
        table = self.runner.table.host
        rows = np.fromiter((r.row for r in reqs), np.int64, B)
        grammar = [b for b, r in enumerate(reqs) if r.matcher is not None]
        bitmask = torch.full((B * K, self.runner.bitmask_width), -1, dtype=torch.int32)
        # candidates, per request: token, path score, parent candidate (-1 = the root), depth
        cand_tok, cand_score, cand_parent, cand_depth = [], [], [], []
        # depth 1: the root's children
        for b in grammar:
            reqs[b].matcher.fill_bitmask(bitmask, b)
        scores = self._log_probs(root_hidden, bitmask[:B] if grammar else None)  # [B, V]
        top_s, top_t = scores.topk(K, -1)
        top_s, top_t = top_s.cpu().numpy(), top_t.cpu().numpy()
        cand_tok.append(top_t)
        cand_score.append(top_s)
        cand_parent.append(np.full((B, K), -1, np.int64))
        cand_depth.append(np.ones((B, K), np.int64))
        frontier = np.tile(np.arange(K), (B, 1))  # candidate index of each frontier node
        front_tok, front_score = top_t, top_s
        parent_hidden = root_hidden.repeat_interleave(K, 0)  # [B*K, H]: the frontier's parents' outputs
        paths = [[[int(t)] for t in front_tok[b]] for b in range(B)]  # token path of each frontier node
        # the head's context: slots of positions [0, n) then the request's scratch slots
        max_ctx = int(n.max())
        ctx_slots = np.zeros((B, max_ctx), np.int64)
        for b in range(B):
            ctx_slots[b, :n[b]] = table[rows[b], :n[b]]
        scratch = self.pool_slots + np.arange(B)[:, None] * self.scratch_per_request + np.arange(self.scratch_per_request)
        slot_table = torch.from_numpy(np.concatenate([ctx_slots, scratch], 1)).to(dev)
        ctx_visible = np.arange(max_ctx)[None, None, :] < n[:, None, None]  # [B, 1, C]
        seen = np.zeros((B, K, self.scratch_per_request), bool)  # tree keys each frontier node sees
        num_cand = K
        for t in range(1, D):
            # the head on the frontier (depth t): position n + t - 1, input its parent's output
            own = (t - 1) * K + np.arange(K)
            seen[:, np.arange(K), own] = True
            mask = np.concatenate([np.broadcast_to(ctx_visible, (B, K, max_ctx)), seen], 2)
            out_slots = scratch[:, own].reshape(-1)
            positions = np.repeat(n + t - 1, K)
            meta = AttentionMetadata(
                mode=ForwardMode.VERIFY, out_slots=torch.from_numpy(out_slots).to(dev),
                q_starts=torch.arange(0, (B + 1) * K, K, dtype=torch.int32, device=dev),
                q_lens=torch.full((B,), K, dtype=torch.int32, device=dev),
                kv_lens=torch.from_numpy(n + self.scratch_per_request).to(dev, torch.int32),
                slot_table=slot_table, max_q_len=K, max_kv_len=slot_table.shape[1],
                tree_mask=torch.from_numpy(mask).to(dev))
            hidden = self.head(self.target, parent_hidden, torch.from_numpy(front_tok.reshape(-1)).to(dev),
                               torch.from_numpy(positions).to(dev), self.kv, meta, self.tree_attention)
            live = np.isfinite(front_score)
            if grammar:
                bitmask.fill_(-1)
            for b in grammar:
                self._fill_rows(reqs[b].matcher, paths[b], live[b], bitmask, b * K)
            scores = self._log_probs(hidden, bitmask if grammar else None)  # [B*K, V]
            scores = scores + torch.from_numpy(np.where(live, front_score, -np.inf).reshape(-1, 1)).to(dev)
            child_s, child_t = scores.topk(K, -1)  # [B*K, K]
            child_s = child_s.view(B, K * K)
            best_s, best_i = child_s.topk(K, -1)  # the next frontier among the K*K children
            child_s, child_t = child_s.cpu().numpy(), child_t.view(B, K * K).cpu().numpy()
            best_i = best_i.cpu().numpy()
            parent_of = frontier[:, np.arange(K * K) // K]  # candidate index of each child's parent
            cand_tok.append(child_t)
            cand_score.append(child_s)
            cand_parent.append(parent_of)
            cand_depth.append(np.full((B, K * K), t + 1, np.int64))
            parent_slot = best_i // K  # frontier index of each new frontier node's parent
            frontier = num_cand + best_i
            num_cand += K * K
            front_tok = np.take_along_axis(child_t, best_i, 1)
            front_score = np.take_along_axis(child_s, best_i, 1)
            paths = [[paths[b][parent_slot[b, j]] + [int(front_tok[b, j])] for j in range(K)] for b in range(B)]
            seen = np.take_along_axis(seen, parent_slot[:, :, None], 1)
            flat = torch.from_numpy((np.arange(B)[:, None] * K + parent_slot).reshape(-1)).to(dev)
            parent_hidden = hidden.index_select(0, flat)
        return _select_trees(np.concatenate(cand_tok, 1), np.concatenate(cand_score, 1),
                             np.concatenate(cand_parent, 1), np.concatenate(cand_depth, 1), N)

    def _log_probs(self, hidden: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
        logits = self.head.logits(self.target, hidden)
        if bitmask is not None:
            logits = mask_logits(logits, bitmask.to(logits.device, non_blocking=True))
        scores = torch.log_softmax(logits, -1)
        return scores.masked_fill_(scores.isnan(), -torch.inf)  # a row the grammar closes: all -inf

    @staticmethod
    def _fill_rows(matcher, paths, live, bitmask: torch.Tensor, first_row: int) -> None:
        """Row first_row + j: the tokens the grammar allows after frontier node j's path (none for
        a dead node, or a path the grammar ended)."""
        for j, path in enumerate(paths):
            row = first_row + j
            took = matcher.accept_tokens(path) if live[j] else 0
            if took == len(path) and not matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row)
            else:
                bitmask[row] = 0
            matcher.rollback(took)


def _select_trees(tok: np.ndarray, score: np.ndarray, parent: np.ndarray, depth: np.ndarray, width: int):
    """The `width - 1` best candidates of each request by path score, as trees in xgrammar's layout
    (node 0 the root, token 0 there: the worker sets it); parents before children, children best first."""
    B, C = tok.shape
    tokens = np.zeros((B, width), np.int64)
    next_token = np.full((B, width), -1, np.int64)
    next_sibling = np.full((B, width), -1, np.int64)
    num_nodes = np.ones(B, np.int64)
    # best first; among equal scores the shallower first, so a parent always precedes its child
    order = np.lexsort((depth, -score), axis=1) if B else np.empty((0, C), np.int64)
    for b in range(B):
        picked = [c for c in order[b, :width - 1] if np.isfinite(score[b, c])]
        picked.sort(key=lambda c: (depth[b, c], -score[b, c]))  # parents first
        node_of = {-1: 0}
        last_child = {}
        i = 0
        for c in picked:
            p = node_of.get(int(parent[b, c]))
            if p is None:  # its parent was not picked (cannot happen with exact scores): drop it
                continue
            i += 1
            node_of[int(c)] = i
            tokens[b, i] = tok[b, c]
            if p in last_child:
                next_sibling[b, last_child[p]] = i
            else:
                next_token[b, p] = i
            last_child[p] = i
        num_nodes[b] = 1 + i
    return tokens, next_token, next_sibling, num_nodes
