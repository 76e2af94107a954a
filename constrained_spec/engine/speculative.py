"""One speculative decode step: draft trees, grammar masking of the trees, tree verification on the
target, KV compaction, and the hand-back of the emitted tokens.

Every request in the batch verifies a tree of exactly N nodes (padded), so the verify forward has
a static shape and can be replayed from a CUDA graph. Node 0 is the request's last sampled token,
whose K/V is not yet cached; the accepted path's K/V stays, rejected slots go back to the pool
in the same step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode
from ..spec.drafter import DraftBatch, Drafter
from ..spec.tree import DraftTrees, allowed_from_bitmask
from ..spec.verify import greedy_verify, rejection_verify
from .batch import ScheduledBatch
from .sampler import SamplingBatch, target_probs

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    steps: int = 0
    verified_requests: int = 0
    accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    histogram: list = field(default_factory=lambda: [0] * 65)  # accepted drafts per request-step
    cpu_draft_seconds: float = 0.0  # drafting + grammar tree masking, on the CPU before verify
    forced_draft_tokens: int = 0  # grammar-forced tokens put into drafts

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per request-step (accepted drafts + the bonus token)."""
        return 1.0 + self.accepted_tokens / max(self.verified_requests, 1)


def make_drafter(config) -> Drafter | None:
    algo = config.speculative_algorithm
    if not algo:
        return None
    if algo == "ngram":
        from ..spec.ngram import NgramDrafter
        return NgramDrafter(num_draft_tokens=config.speculative_num_draft_tokens, branches=config.ngram_branches,
                            max_ngram=config.ngram_max_match, min_ngram=config.ngram_min_match,
                            capacity=config.ngram_capacity)
    raise ValueError(f"unknown speculative algorithm {algo!r}; available: ngram")


class SpeculativeWorker:
    def __init__(self, engine, drafter: Drafter):
        self.engine = engine
        self.runner = engine.runner
        self.drafter = drafter
        self.width = drafter.num_draft_tokens
        self.stats = SpecStats()
        self._observed: dict[str, int] = {}  # request id -> output tokens already given to the drafter
        self._recent: list[float] = []  # accepted drafts per request-step, recent window (fallback rule)
        self._bitmask: torch.Tensor | None = None  # pinned [rows, W], reused across steps

    # -- policy ----------------------------------------------------------------------------------
    def should_speculate(self, batch: ScheduledBatch) -> bool:
        """Plain decoding for batches where speculation loses: too large a batch, requests that need
        per-token state we do not verify (penalties, logprobs), or drafts that keep failing."""
        cfg = self.engine.config
        if batch.size > cfg.speculative_max_batch:
            return False
        if any(r.params.frequency_penalty or r.params.presence_penalty or r.params.logprobs is not None
               for r in batch.requests):
            return False
        if len(self._recent) >= 32 and sum(self._recent) / len(self._recent) < cfg.speculative_min_accept:
            self._recent = self._recent[8:]  # probe again after a few plain steps
            return False
        return True

    def forget(self, req) -> None:
        if self._observed.pop(req.request_id, None) is not None:
            self.drafter.finish(req.request_id)

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> None:
        engine, runner = self.engine, self.runner
        reqs = batch.requests
        t0 = time.perf_counter()
        trees, bitmask = self._draft(reqs)
        self.stats.cpu_draft_seconds += time.perf_counter() - t0
        B, N = len(reqs), self.width

        base = np.array([r.num_cached for r in reqs], dtype=np.int64)
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        for r in reqs:
            runner.table.append(r.row, runner.pool.alloc(N))
            r.num_cached += N
        table_pos = (base[:, None] + np.arange(N)).reshape(-1)  # node i sits at table column base + i
        positions = (base[:, None] + trees.depth.numpy()).reshape(-1)  # RoPE position: base + depth
        slots = runner.table.host[np.repeat(rows, N), table_pos]
        packed = runner._to_device(np.concatenate([rows, np.repeat(rows, N), table_pos, positions, slots,
                                                   trees.tokens.numpy().reshape(-1)]))
        rows_d, node_rows_d, table_pos_d, pos_d, slots_d, tok_d = torch.split(packed, [B] + [B * N] * 5)
        runner.table.write_device(node_rows_d, table_pos_d, slots_d)
        kv_lens = torch.from_numpy(base + N).to(runner.device, non_blocking=True).to(torch.int32)
        mask_d = trees.mask.to(runner.device, non_blocking=True)
        logits = self._verify_forward(B, N, tok_d, pos_d, slots_d, kv_lens, rows_d, mask_d)
        if bitmask is not None:
            engine.grammar.apply_bitmask(logits, bitmask.view(B * N, -1).to(runner.device, non_blocking=True))
        result = self._verify(reqs, trees.to(runner.device), logits.view(B, N, -1))
        path = result.accepted_nodes.cpu().numpy()  # the one sync of the step
        emitted = result.emitted_tokens.cpu().numpy()
        lens = result.accept_lens.cpu().numpy()
        runner.last_token[rows_d] = result.bonus_tokens
        self._commit(reqs, base, rows, path, lens, emitted)

    def _verify_forward(self, B, N, tok_d, pos_d, slots_d, kv_lens, rows_d, mask_d):
        runner = self.runner
        graphs = runner.graphs
        if graphs is not None and graphs.can_verify(B, N):
            return graphs.replay_verify(B, N, tok_d, pos_d, slots_d, kv_lens, runner.table.device_table[rows_d],
                                        mask_d)
        max_kv = int(kv_lens.max()) if runner.device.type == "cpu" else runner.max_context
        q_lens = torch.full((B,), N, dtype=torch.int32, device=runner.device)
        meta = AttentionMetadata(
            mode=ForwardMode.VERIFY, out_slots=slots_d,
            q_starts=torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=runner.device),
            q_lens=q_lens, kv_lens=kv_lens, slot_table=runner.table.device_table[rows_d, :max_kv],
            max_q_len=N, max_kv_len=max_kv, tree_mask=mask_d)
        hidden = runner.model(tok_d, pos_d, runner.kv, meta, runner.backend)
        return runner.model.compute_logits(hidden).float()

    def _verify(self, reqs, trees: DraftTrees, logits: torch.Tensor):
        if all(r.params.greedy for r in reqs):
            return greedy_verify(trees, logits)
        sb = self.runner._sampling_batch(reqs, None)
        B, N, V = logits.shape
        expand = lambda t: t.repeat_interleave(N)
        sbn = SamplingBatch(temperature=expand(sb.temperature), top_k=expand(sb.top_k), top_p=expand(sb.top_p),
                            min_p=expand(sb.min_p), seeds=expand(sb.seeds), steps=expand(sb.steps),
                            needs_filter=sb.needs_filter)
        probs = target_probs(logits.view(B * N, V), sbn).view(B, N, V)
        greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
        return rejection_verify(trees, probs, greedy=greedy)

    # -- drafting and grammar masking ------------------------------------------------------------
    def _draft(self, reqs) -> tuple[DraftTrees, torch.Tensor | None]:
        for r in reqs:  # bring the drafter's stream up to date: prompt + every emitted token
            seen = self._observed.get(r.request_id)
            if seen is None:
                self.drafter.add_request(r.request_id, r.prompt_ids)
                seen = 0
            if seen < len(r.output_ids):
                self.drafter.observe(r.request_id, r.output_ids[seen:])
            self._observed[r.request_id] = len(r.output_ids)
        trees = self.drafter.propose(DraftBatch([r.request_id for r in reqs]))
        trees = self._forced_drafts(reqs, trees)
        if not any(r.matcher is not None for r in reqs):
            return trees, None
        B, N = trees.tokens.shape
        if self._bitmask is None or self._bitmask.shape[0] < B * N:
            self._bitmask = self.engine.grammar.allocate_bitmask(max(B, 8) * N)
        bitmask = self._bitmask[:B * N].view(B, N, -1)
        bitmask.fill_(-1)
        for b, r in enumerate(reqs):
            if r.matcher is not None:
                layout = trees.layout(b)
                r.matcher.traverse_draft_tree(*layout, bitmask[b, :len(layout[0])])
        pruned, old_index = trees.prune(allowed_from_bitmask(trees, bitmask))
        bitmask = bitmask.gather(1, old_index.clamp(min=0)[:, :, None].expand(-1, -1, bitmask.shape[2]))
        return pruned, bitmask

    def _forced_drafts(self, reqs, trees: DraftTrees) -> DraftTrees:
        """Grammar-forced strings go first: they are certain to be legal, so draft them as a chain."""
        forced = {b: r.matcher.jump_forward_tokens(self.engine.tokenizer)[:self.width - 1]
                  for b, r in enumerate(reqs) if r.matcher is not None}
        forced = {b: f for b, f in forced.items() if f}
        if not forced:
            return trees
        lists = []
        for b in range(len(reqs)):
            if b in forced:
                toks = [int(trees.tokens[b, 0])] + forced[b]
                n = len(toks)
                lists.append((toks, [i + 1 if i + 1 < n else -1 for i in range(n)], [-1] * n))
                self.stats.forced_draft_tokens += n - 1
            else:
                lists.append(tuple(t.tolist() for t in (trees.tokens[b], trees.next_token[b], trees.next_sibling[b])))
        return DraftTrees.from_lists(lists, width=self.width)

    # -- after verification ----------------------------------------------------------------------
    def _commit(self, reqs, base, rows, path, lens, emitted) -> None:
        runner, engine = self.runner, self.engine
        N = self.width
        moved_rows, moved_pos, moved_slots = [], [], []
        for b, r in enumerate(reqs):
            keep = path[b, :lens[b] + 1]  # root + accepted nodes
            row = rows[b]
            node_slots = runner.table.host[row, base[b]:base[b] + N].copy()
            runner.table.host[row, base[b]:base[b] + len(keep)] = node_slots[keep]
            rejected = np.setdiff1d(node_slots, node_slots[keep], assume_unique=True)
            runner.table.lengths[row] = base[b] + len(keep)
            runner.pool.free(rejected)
            r.num_cached = int(base[b] + len(keep))
            if not np.array_equal(keep, np.arange(len(keep))):
                moved_rows.append(np.full(len(keep), row))
                moved_pos.append(base[b] + np.arange(len(keep)))
                moved_slots.append(node_slots[keep])
            r.spec_steps += 1
            r.spec_accepted += int(lens[b])
            self.stats.verified_requests += 1
            self.stats.accepted_tokens += int(lens[b])
            self.stats.histogram[min(int(lens[b]), 64)] += 1
            self._recent.append(float(lens[b]))
        if moved_rows:
            dev = lambda parts: runner._to_device(np.concatenate(parts).astype(np.int64))
            runner.table.write_device(dev(moved_rows), dev(moved_pos), dev(moved_slots))
        self._recent = self._recent[-256:]
        self.stats.steps += 1
        for b, r in enumerate(reqs):
            for tok in emitted[b, :lens[b] + 1]:
                if r.finished:
                    break
                engine._append_token(r, int(tok), None)
