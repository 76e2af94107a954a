"""EAGLE drafter: a draft tree per request from the EAGLE head (`models/eagle.py`), grammar-masked
while it is drafted (EAGLE-2's dynamic tree).

Per speculative step, for the requests of the batch:
  extend  the head runs over the positions it has not seen yet (the last step's accepted tokens,
          or more after plain steps and prefills): input f_i, the target's pre-norm hidden state
          that every forward leaves at position i's KV slot (`ModelRunner.features`), and the token
          at i + 1; its K/V go to the same slot of the head's own one-layer KV cache, so the head
          shares the target's slot table and needs no bookkeeping of its own. Its output at the
          last position is the guess of the root's hidden state.
  expand  depth by depth (`eagle_step.DraftIO`: one CUDA graph per batch size serves every depth): the
          frontier's logits (target norm + LM head) are masked by the request's grammar (each
          frontier node's path accepted into its matcher, one bitmask row filled, rolled back),
          log-softmaxed and added to the node's path score; every node gets its top-k children as
          candidates, and the k best candidates become the next frontier, which the head runs on as
          a decode step over its context and its ancestors in the tree. A token the grammar forbids
          scores -inf and is never drafted; a forced token scores its parent's score, so forced runs
          are drafted whole. Without a grammar in the batch the host reads the records once at the
          end; with one it reads each depth's frontier (its mask rows depend on it).
  select  the N - 1 best candidates by path score (a child never outscores its parent, so the
          choice is a tree), laid out parents first in xgrammar's layout.
The worker still checks every tree with the grammar's traversal before verifying it. Drafts are
deterministic (top-k), so the worker's path-matching verification stays lossless at any temperature.
On CUDA the extend with depth 1 (up to N unseen positions per request; more, after plain steps or a
prefill, run eagerly) and each expansion step replay CUDA graphs (`CudaGraphRunner.capture_draft`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode, KVCache
from .drafter import DraftBatch, Drafter
from .eagle_step import DraftIO
from .tree import DraftTrees

__all__ = ["DraftProfile", "EagleDrafter"]


DRAFT_PHASES = ("inputs", "root_mask", "start", "depth_masks", "steps", "read", "select")


@dataclass
class DraftProfile:
    """Host seconds per phase of `propose_arrays`, summed over its calls, and its host-device
    syncs: what a speculative step's drafting costs on the host (bench_spec reports it per step).
    inputs: unseen positions, token ids, slots, staging; root_mask: depth 1's grammar rows;
    start / steps: launching (CUDA) or computing (CPU) the head's extend and depth steps;
    depth_masks: reading each depth's frontier and filling its grammar rows; read: the final
    read-back; select: the trees from the candidates."""
    calls: int = 0
    syncs: int = 0
    eager: int = 0  # calls whose device work ran eagerly (always on the CPU; on CUDA, no graph fitted)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(DRAFT_PHASES, 0.0))
    _t: float = 0.0

    def begin(self) -> None:
        self.calls += 1
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now


class EagleDrafter(Drafter):
    needs_requests = True

    def __init__(self, runner, head, num_draft_tokens: int = 8, topk: int = 4, depth: int = 6, capacity: int = 32):
        if topk < 1 or not 1 <= depth < num_draft_tokens:
            raise ValueError(f"EAGLE needs topk >= 1 and 1 <= depth < draft tokens ({num_draft_tokens}); "
                             f"got topk {topk}, depth {depth}")
        self.runner, self.head, self.target = runner, head, runner.model
        if runner.features is None:
            raise ValueError("the model runner keeps no hidden states (speculative_algorithm must be 'eagle')")
        self.num_draft_tokens = num_draft_tokens
        self.topk, self.depth = topk, depth
        self.device = runner.device
        cfg = runner.mcfg
        self.pool_slots = runner.kv.num_slots
        self.scratch_per_request = topk * depth
        capacity = max(1, min(capacity, runner.max_rows))
        self.kv = KVCache(1, self.pool_slots + capacity * self.scratch_per_request, cfg.num_kv_heads, cfg.head_dim,
                          runner.dtype, self.device)
        self.io = DraftIO(runner, head, self.kv, topk, depth, capacity, width=num_draft_tokens)
        # request id -> (row, slot of position 0, positions the head has seen, slot of the last of them)
        self._seen: dict[Hashable, tuple[int, int, int, int]] = {}
        self.profile = DraftProfile()

    # -- the Drafter interface -------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftTrees:
        return DraftTrees.from_arrays(*self.propose_arrays(batch))

    @torch.inference_mode()
    def propose_arrays(self, batch: DraftBatch):
        reqs = batch.requests
        if reqs is None:
            raise ValueError("the EAGLE drafter needs DraftBatch.requests")
        B, K, D, io, prof = len(reqs), self.topk, self.depth, self.io, self.profile
        prof.begin()
        rows = np.fromiter((r.row for r in reqs), np.int64, B)
        n, start = self._unseen(reqs)
        q_lens = n - start
        graphs = self.runner.graphs
        graphed = graphs is not None and graphs.can_draft(B) and int(q_lens.max()) <= io.width
        bs = graphs.padded_size(B) if graphed else B
        prof.eager += not graphed
        table = self.runner.table.host
        pos = np.concatenate([np.arange(s, e) for s, e in zip(start, n)])
        slots = table[np.repeat(rows, q_lens), pos]
        ids = np.concatenate([np.asarray(_tokens(r, s + 1, e + 1), np.int64) for r, s, e in zip(reqs, start, n)])
        grammar = [b for b, r in enumerate(reqs) if r.matcher is not None]
        masks = io.bitmask_host
        prof.lap("inputs")
        if grammar:  # depth 1: the root's children, masked by the request's grammar as it stands
            masks[:bs] = -1
            for b in grammar:
                reqs[b].matcher.fill_bitmask(masks, b)
        prof.lap("root_mask")
        eager = io.set_inputs(bs, rows, n, ids, pos, slots, q_lens, graphed)
        prof.lap("inputs")
        on_cpu = self.device.type == "cpu"
        if graphed:
            graphs.replay_draft("start", bs, bool(grammar))
        else:
            io.start(bs, bool(grammar), eager, int(q_lens.max()), int(n.max()) if on_cpu else None)
        max_kv = int(n.max()) + D if on_cpu else None
        prof.lap("start")
        paths = None
        for t in range(1, D):
            if grammar:  # the frontier's rows: each node's path accepted into its matcher, then rolled back
                tok, score, chosen = io.frontier_host(B)
                prof.syncs += 1
                if paths is None:
                    paths = [[[int(x)] for x in tok[b]] for b in range(B)]
                else:
                    parent = chosen // K
                    paths = [[paths[b][parent[b, j]] + [int(tok[b, j])] for j in range(K)] for b in range(B)]
                masks[:bs * K] = -1
                for b in grammar:
                    _fill_rows(reqs[b].matcher, paths[b], np.isfinite(score[b]), masks, b * K)
                prof.lap("depth_masks")
            if graphed:
                graphs.replay_draft("step", bs, bool(grammar))
            else:
                io.step(bs, bool(grammar), max_kv)
            prof.lap("steps")
        tok, score, best = io.outputs_host(B, D)
        prof.syncs += 1
        prof.lap("read")
        trees = _select_trees(*_candidates(tok, score, best, K), self.num_draft_tokens)
        prof.lap("select")
        return trees

    def finish(self, request_id: Hashable) -> None:
        self._seen.pop(request_id, None)

    def reset(self) -> bool:
        self._seen.clear()
        return True

    def _unseen(self, reqs) -> tuple[np.ndarray, np.ndarray]:
        """(cached lengths n, first position the head has not seen) per request, and the record
        updated as if it had seen them all: it will, in this step. The head re-reads a request
        from its start when its row or slots changed (a retraction), and always reads the last
        cached position again (its output is the root's hidden state)."""
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
            start[b] = min(d, n[b] - 1)
            self._seen[r.request_id] = (r.row, int(table[r.row, 0]), int(n[b]), int(table[r.row, n[b] - 1]))
        return n, start


def _tokens(req, start: int, stop: int) -> list[int]:
    """The request's tokens at positions [start, stop), without copying its whole context."""
    p = len(req.prompt_ids)
    if start >= p:
        return req.output_ids[start - p:stop - p]
    return req.prompt_ids[start:stop] + req.output_ids[:max(stop - p, 0)]


def _fill_rows(matcher, paths, live, bitmask: torch.Tensor, first_row: int) -> None:
    """Row first_row + j: the tokens the grammar allows after frontier node j's path (none for a
    dead node, or a path the grammar ended). The paths are walked in sorted order, rolling back only
    to the prefix the next one shares, so a common stem is accepted once."""
    on: list[int] = []  # the tokens the matcher has accepted beyond where it started
    for j in sorted(range(len(paths)), key=lambda j: paths[j]):
        row, path = first_row + j, paths[j]
        if not live[j]:
            bitmask[row] = 0
            continue
        keep = 0
        while keep < min(len(on), len(path)) and on[keep] == path[keep]:
            keep += 1
        matcher.rollback(len(on) - keep)
        del on[keep:]
        took = matcher.accept_tokens(path[keep:])
        on += path[keep:keep + took]
        if len(on) == len(path) and not matcher.is_terminated():
            matcher.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = 0
    matcher.rollback(len(on))


def _candidates(tok: np.ndarray, score: np.ndarray, best: np.ndarray, K: int):
    """The draft steps' records ([B, D, K*K] children per depth, [B, D, K] chosen) as flat candidate
    arrays [B, C]: token, path score, parent candidate (-1: the root), depth."""
    B, D, _ = tok.shape
    toks, scores, parents, depths = [tok[:, 0, :K]], [score[:, 0, :K]], [np.full((B, K), -1, np.int64)], \
        [np.ones((B, K), np.int64)]
    frontier = np.tile(np.arange(K), (B, 1))  # candidate index of each frontier node
    base = K
    for t in range(1, D):
        toks.append(tok[:, t])
        scores.append(score[:, t])
        parents.append(frontier[:, np.arange(K * K) // K])
        depths.append(np.full((B, K * K), t + 1, np.int64))
        frontier = base + best[:, t]
        base += K * K
    return (np.concatenate(toks, 1), np.concatenate(scores, 1), np.concatenate(parents, 1),
            np.concatenate(depths, 1))


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
