"""EAGLE drafter: a draft tree per request from the EAGLE head (`models/eagle.py`), EAGLE-2's
dynamic tree, masked by the request's grammar at depth 1 and checked by it before verification.

Per speculative step, for the requests of the batch:
  extend  the head runs over the positions it has not seen yet (the last step's accepted tokens,
          or more after plain steps and prefills): input f_i, the target's pre-norm hidden state
          that every forward leaves at position i's KV slot (`ModelRunner.features`), and the token
          at i + 1; its K/V go to the same slot of the head's own one-layer KV cache, so the head
          shares the target's slot table and needs no bookkeeping of its own. Its output at the
          last position is the guess of the root's hidden state. On CUDA the start graph takes up
          to N such positions per request; a request further behind is caught up eagerly first
          (`_catch_up`, its K/V only), so the start and every depth still replay their graphs.
  expand  depth by depth (`eagle_step.DraftIO`: one CUDA graph per batch size serves every depth):
          the frontier's logits (target norm + LM head) are log-softmaxed and added to the node's
          path score; every node gets its top-k children as candidates, and the k best candidates
          become the next frontier, which the head runs on as a decode step over its context and
          its ancestors in the tree. Depth 1 (the root's children) is masked by the grammar: one
          row per request, filled on the engine's grammar pool before the start. Depths 2..M
          (`eagle_masked_depths`, default 1: none) are masked too: the host reads the frontier (a
          sync), accepts each frontier node's path into its matcher, fills its row and rolls back,
          before the step's replay. Deeper depths are not masked, so they run back to back on the
          device, and the host reads the records once, at the end: one sync per step at M = 1.
  select  the N - 1 best candidates by path score (a child never outscores its parent, so the
          choice is a tree), laid out parents first in xgrammar's layout, vectorized over the batch.
The worker then fills every tree node's verify row (copying the rows drafting filled for the same
paths: the roots' and the masked frontiers', `filled_rows`) and prunes the nodes the grammar forbids
with their subtrees, so only legal tokens are verified and the bonus token is legal too. Drafts are deterministic (top-k), so the worker's path-matching
verification stays lossless at any temperature.

Why most depths are unmasked (measured, issue 23): masking depth t needs the frontier of depth
t - 1 on the host (a sync), then each frontier node's path accepted into its matcher, a row filled
and rolled back, before the next replay: with every one of 6 depths masked at top-k 4 that was 6
syncs and 21 row fills a request per step, 7-24 ms of host time a step on the H100 host against a
~1 ms plain decode step (part of it eager draft steps after plain ones: now caught up instead), so
the measured policy never speculated. Overlapping the fills on another thread does not help: each
depth's rows depend on the depth before, which depends on its rows. SmolLM2's shipped head on the
JSON tasks (4 tasks x 64 tokens, float32, CPU, batch 1) emits per verify step: 2.41 tokens with
every depth masked, 2.41 with depths 1-2 (M = 2: one more sync, 4 rows a request), 2.05 with depth
1 alone (M = 1), 2.00 with none. Depth 1 is therefore always masked (its rows cost no sync); M = 2
buys a sixth more tokens per step for a sync and k fills a request, which pays where a fill is cheap
against the device step (the H100 decides: bench_spec's "eagle mask2" beside "eagle"). Choosing
the best *legal* candidates instead (walking them through the matcher before the tree is picked)
gave 2.08 at M = 1: not worth its host time; the traversal prunes instead.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Hashable

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode, KVCache
from .drafter import DraftBatch, Drafter
from .eagle_step import DraftIO
from .tree import DraftTrees

__all__ = ["DraftProfile", "EagleDrafter"]


DRAFT_PHASES = ("catch_up", "inputs", "root_mask", "start", "depth_masks", "steps", "read", "select")


@dataclass
class DraftProfile:
    """Host seconds per phase of `propose_arrays`, summed over its calls, and its host-device
    syncs: what a speculative step's drafting costs on the host (bench_spec reports it per step).
    catch_up: the eager extend of positions past the start graph's width; inputs: unseen
    positions, token ids, slots, staging; root_mask: depth 1's grammar rows; start / steps:
    launching (CUDA) or computing (CPU) the head's extend and depth steps; depth_masks: reading
    the frontier and filling its rows for the masked depths past the first; read: the final
    read-back (on CUDA, the wait for the draft work); select: the trees from the candidates."""
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

    def __init__(self, runner, head, num_draft_tokens: int = 8, topk: int = 4, depth: int = 6, capacity: int = 32,
                 masked_depths: int = 1, fused_chain: bool = True):
        if topk < 1 or not 1 <= depth < num_draft_tokens:
            raise ValueError(f"EAGLE needs topk >= 1 and 1 <= depth < draft tokens ({num_draft_tokens}); "
                             f"got topk {topk}, depth {depth}")
        if masked_depths < 1:
            raise ValueError(f"EAGLE masks at least depth 1 by the grammar; got masked depths {masked_depths}")
        self.masked_depths = min(masked_depths, depth)
        self.fuses_chains = fused_chain and topk == 1
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
        self.io = DraftIO(runner, head, self.kv, topk, depth, capacity, width=num_draft_tokens,
                          masked_steps=self.masked_depths > 1)
        # request id -> (row, slot of position 0, positions the head has seen, slot of the last of them)
        self._seen: dict[Hashable, tuple[int, int, int, int]] = {}
        self.profile = DraftProfile()
        self._filler = None  # `use_mask_filler`
        # the masked depths' grammar rows of a step, kept for its verify tree (`filled_rows`): the
        # roots' at depth 0, the frontier's of depth t at t; and each tree node's row in them
        # (numpy: a loaded engine thread spent ~7x longer in torch's copies and indexing here)
        self._kept = np.empty((self.masked_depths, capacity * topk, self.io.bitmask_host.shape[1]), np.int32)
        self._node_rows: np.ndarray | None = None
        self._masks_np = self.io.bitmask_host.numpy()

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
        n, start = self._unseen(reqs, rows)
        graphs = self.runner.graphs
        graphed = graphs is not None and graphs.can_draft(B)
        max_kv = int(n.max()) + D if self.device.type == "cpu" else None  # the torch backend's masks scale with it
        if graphed and int((n - start).max()) > io.width:  # after a prefill or plain steps
            start = self._catch_up(reqs, rows, n, start, max_kv)
            prof.lap("catch_up")
        prof.eager += not graphed
        bs = graphs.padded_size(B) if graphed else B
        q_lens = n - start
        ids, pos, slots = self._packed(reqs, rows, start, n)
        prof.lap("inputs")
        masked = self._fill_root_masks(reqs, bs)
        kept = 0  # depths whose grammar rows are kept for the verify tree (`filled_rows`)
        if masked:
            kept = self._keep_rows(0, B)
        prof.lap("root_mask")
        eager = io.set_inputs(bs, rows, n, ids, pos, slots, q_lens, graphed)
        if graphed:
            graphs.replay_draft("start", bs, masked)
        else:
            io.start(bs, masked, eager, int(q_lens.max()), max_kv)
        prof.lap("start")
        paths = None
        for t in range(1, D):  # step t drafts depth t + 1: unmasked ones run back to back on the device
            masked = masked and t < self.masked_depths
            if masked:  # the frontier's rows: each node's path accepted into its matcher, then rolled back
                front, front_score, chosen = self.wait_for_device(partial(io.frontier_host, B, t - 1))
                prof.syncs += 1
                paths = _extend_paths(paths, front, chosen, K)
                self._fill_frontier_masks(reqs, paths, front_score, bs)
                kept = self._keep_rows(t, B * K)
                prof.lap("depth_masks")
            if graphed:
                graphs.replay_draft("step", bs, masked)
            else:
                io.step(bs, masked, max_kv)
            prof.lap("steps")
        tok, score, best = self.wait_for_device(partial(io.outputs_host, B, D))  # the one read of the drafting
        prof.syncs += 1
        prof.lap("read")
        *trees, node_cand = _select_trees(*_candidates(tok, score, best, K), self.num_draft_tokens)
        self._node_rows = _kept_rows_of_nodes(node_cand, best, K, kept, self._kept.shape[1]) if kept else None
        prof.lap("select")
        return tuple(trees)

    def filled_rows(self):
        rows, self._node_rows = self._node_rows, None
        return None if rows is None else (self._kept.reshape(-1, self._kept.shape[-1]), rows)

    def _keep_rows(self, depth: int, n: int) -> int:
        """Keeps the first n grammar rows just filled (depth 0: the roots'; t: the frontier of
        depth t), which the verify tree's nodes on those paths need again. Returns the depths kept."""
        self._kept[depth, :n] = self._masks_np[:n]
        return depth + 1

    def finish(self, request_id: Hashable) -> None:
        self._seen.pop(request_id, None)

    def saw(self, reqs) -> None:
        """The head has seen every cached position of these requests (a fused chain step ran it
        over them, `chain_step.py`)."""
        table = self.runner.table.host
        for r in reqs:
            n = r.num_cached
            self._seen[r.request_id] = (r.row, int(table[r.row, 0]), n, int(table[r.row, n - 1]))

    def reset(self) -> bool:
        self._seen.clear()
        return True

    def _unseen(self, reqs, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cached lengths n, first position the head has not seen) per request, and the record
        updated as if it had seen them all: it will, in this step. The head re-reads a request
        from its start when its row or slots changed (a retraction), and always reads the last
        cached position again (its output is the root's hidden state)."""
        table = self.runner.table.host
        B = len(reqs)
        ids = [r.request_id for r in reqs]
        n = np.fromiter((r.num_cached for r in reqs), np.int64, B)
        seen = np.array([self._seen.get(i, _NOTHING_SEEN) for i in ids], np.int64).reshape(B, 4)
        count = seen[:, 2]
        first = table[rows, 0]
        same = ((seen[:, 0] == rows) & (seen[:, 1] == first) & (count > 0) & (count <= n)
                & (table[rows, np.maximum(count - 1, 0)] == seen[:, 3]))
        start = np.minimum(np.where(same, count, 0), n - 1)
        self._seen.update(zip(ids, np.stack([rows, first, n, table[rows, n - 1]], 1).tolist()))
        return n, start

    def _packed(self, reqs, rows: np.ndarray, start: np.ndarray, stop: np.ndarray):
        """The positions [start, stop) of each request, packed: the next token at each (the head's
        input beside the feature there), the position, its KV slot."""
        q_lens = stop - start
        first = np.zeros(len(q_lens), np.int64)
        np.cumsum(q_lens[:-1], out=first[1:])
        pos = np.arange(int(q_lens.sum())) + np.repeat(start - first, q_lens)
        slots = self.runner.table.host[np.repeat(rows, q_lens), pos]
        ids = np.fromiter(itertools.chain.from_iterable(
            _tokens(r, s + 1, e + 1) for r, s, e in zip(reqs, start.tolist(), stop.tolist())), np.int64, len(pos))
        return ids, pos, slots

    def _catch_up(self, reqs, rows, n, start, max_kv) -> np.ndarray:
        """Runs the head eagerly over all but the last `width` unseen positions of each request
        (after a prefill or plain steps), so that the step's start fits its CUDA graph. Returns the
        new first unseen positions."""
        stop = np.maximum(start, n - self.io.width)
        behind = np.nonzero(stop > start)[0]
        ids, pos, slots = self._packed([reqs[b] for b in behind], rows[behind], start[behind], stop[behind])
        self.io.catch_up(rows[behind], stop[behind], ids, pos, slots, stop[behind] - start[behind], max_kv)
        return stop

    def _fill_frontier_masks(self, reqs, paths, score: np.ndarray, bs: int) -> None:
        """A masked depth past the first: row b * K + j holds the tokens request b's grammar allows
        after frontier node j's path, none for a dead node (no candidate); requests without a
        grammar allow all. The engine's grammar pool walks the paths (`MaskFiller.fill_paths`:
        the frontier of one request on several forks of its matcher at once)."""
        masks, K = self._masks_np, self.topk
        masks[:bs * K] = -1
        if self._filler is None:
            raise RuntimeError("masked EAGLE depths need the engine's grammar pool (`use_mask_filler`)")
        live = np.isfinite(score).tolist()
        matchers, node_paths, node_rows = [], [], []
        for b, r in enumerate(reqs):  # plain lists: a few small numpy calls a depth cost more (batch 1)
            if r.matcher is None:
                continue
            matchers.append(r.matcher)
            node_paths.append([p for p, ok in zip(paths[b], live[b]) if ok])
            node_rows.append([b * K + j for j, ok in enumerate(live[b]) if ok])
            for j, ok in enumerate(live[b]):
                if not ok:
                    masks[b * K + j] = 0
        if matchers:
            self._filler.fill_paths(matchers, node_paths, node_rows, self.io.bitmask_host)

    def use_mask_filler(self, filler) -> None:
        """Fill the roots' rows on the engine's grammar pool (`MaskFiller.fill_chains`, a chain of
        the root alone per request), in parallel, instead of one after another here."""
        self._filler = filler

    def _fill_root_masks(self, reqs, bs: int) -> bool:
        """Depth 1's grammar rows: the tokens each request's grammar allows after its root (all the
        drafting's grammar work at one masked depth). Returns whether any request has a grammar
        (the start then masks)."""
        grammar = [b for b, r in enumerate(reqs) if r.matcher is not None]
        if not grammar:
            return False
        masks = self.io.bitmask_host
        masks[:bs] = -1
        matchers = [reqs[b].matcher for b in grammar]
        if self._filler is not None:
            # a chain of the root alone: its row filled, no token accepted (so no stop tokens to know)
            self._filler.fill_chains(matchers, [[reqs[b].output_ids[-1]] for b in grammar], masks, grammar,
                                     frozenset())
        else:
            for b, m in zip(grammar, matchers):
                m.fill_bitmask(masks, b)
        return True


_NOTHING_SEEN = (-1, -1, 0, -1)  # a request the head has not seen: no row matches -1


def _tokens(req, start: int, stop: int) -> list[int]:
    """The request's tokens at positions [start, stop), without copying its whole context."""
    p = len(req.prompt_ids)
    if start >= p:
        return req.output_ids[start - p:stop - p]
    return req.prompt_ids[start:stop] + req.output_ids[:max(stop - p, 0)]


def _extend_paths(paths, front: np.ndarray, chosen: np.ndarray, K: int) -> list:
    """Each request's frontier paths (tokens after the root) one depth on: new node j of request b
    is a child of the old frontier node chosen[b, j] // K, with token front[b, j]."""
    if paths is None:
        return [[[x] for x in row] for row in front.tolist()]
    parent = (chosen // K).tolist()
    return [[paths[b][p] + [x] for p, x in zip(parent[b], row)] for b, row in enumerate(front.tolist())]


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
    """The `width - 1` best candidates of each request by path score (finite ones only), as trees
    in xgrammar's layout (node 0 the root, token 0 there: the worker sets it); parents before
    children, children best first. Vectorized over the batch: a child never outscores its parent
    (its score adds a log-probability) and ties go to the shallower, so the picks are closed
    under parents."""
    B, C = tok.shape
    tokens = np.zeros((B, width), np.int64)
    next_token = np.full((B, width), -1, np.int64)
    next_sibling = np.full((B, width), -1, np.int64)
    node_cand = np.full((B, width), -1, np.int64)
    if B == 0:
        return tokens, next_token, next_sibling, np.ones(0, np.int64), node_cand
    take = lambda a, i: np.take_along_axis(a, i, 1)
    best = np.lexsort((depth, -score), axis=1)[:, :width - 1]  # best first; a parent before its child
    picked = np.isfinite(take(score, best))
    # lay the picks out parents first (by depth, then best first), unpicked at the end
    layout = np.lexsort((-take(score, best), np.where(picked, take(depth, best), C)), axis=1)
    cand, picked = take(best, layout), take(picked, layout)
    b, i = np.nonzero(picked)  # node i + 1 of request b is candidate cand[b, i]
    node_of = np.full((B, C + 1), -1, np.int64)  # column C: the root (parent -1)
    node_of[:, C] = 0
    node_of[b, cand[b, i]] = i + 1
    par = parent[b, cand[b, i]]
    pnode = node_of[b, np.where(par < 0, C, par)]  # -1: its parent was not picked (cannot happen: left unlinked)
    tokens[b, i + 1] = tok[b, cand[b, i]]
    node_cand[b, i + 1] = cand[b, i]
    linked = pnode >= 0
    b, i, pnode = b[linked], i[linked], pnode[linked]
    first_child = np.full((B, width), width, np.int64)
    np.minimum.at(first_child, (b, pnode), i + 1)
    next_token[first_child < width] = first_child[first_child < width]
    order = np.lexsort((i, pnode, b))  # siblings in node order: the next one with the same parent
    bo, io, po = b[order], i[order], pnode[order]
    same = (bo[1:] == bo[:-1]) & (po[1:] == po[:-1])
    next_sibling[bo[:-1][same], io[:-1][same] + 1] = io[1:][same] + 1
    return tokens, next_token, next_sibling, 1 + picked.sum(1), node_cand


def _kept_rows_of_nodes(node_cand: np.ndarray, best: np.ndarray, K: int, kept: int, per_depth: int) -> np.ndarray:
    """[B, width] each tree node's row among the kept rows (`EagleDrafter._keep_rows`, flattened:
    depth * per_depth + row), -1 for nodes whose row was not filled while drafting: the root's is
    row b of depth 0; frontier node j of depth t (candidate j at depth 1, K + (t - 2) K^2 + its
    choice at depth t past it; `_candidates`) is row b * K + j of depth t, for t < kept."""
    B, width = node_cand.shape
    C = K + (best.shape[1] - 1) * K * K
    lookup = np.full((B, C + 1), -1, np.int64)  # column C: no candidate (node_cand -1)
    b = np.arange(B)[:, None]
    if kept > 1:  # every kept depth's frontier at once: [B, kept - 1, K] candidates and their rows
        deeper = K + np.arange(kept - 2)[None, :, None] * K * K + best[:, 1:kept - 1]
        cand = np.concatenate([np.broadcast_to(np.arange(K), (B, 1, K)), deeper], 1)
        lookup[b[:, :, None], cand] = np.arange(1, kept)[None, :, None] * per_depth + b[:, :, None] * K + np.arange(K)
    rows = lookup[b, np.where(node_cand >= 0, node_cand, C)]
    rows[:, 0] = np.arange(B)  # the root's
    return rows

