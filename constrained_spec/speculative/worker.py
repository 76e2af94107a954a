"""One speculative decode step: draft trees, grammar masking of the trees, tree verification on the
target, KV compaction, and the hand-back of the emitted tokens.

Every request in the batch verifies a tree of exactly N nodes (padded), so the verify forward has
a static shape and replays from a CUDA graph. Node 0 is the request's last sampled token, whose
K/V is not yet cached; the accepted path's K/V stays, rejected slots go back to the pool in the
same step.

Host and device split the work so that the device sees few launches and the host reads back once:
  host    drafts (n-gram trie; grammar-guided chains), tree structure (depth, ancestor mask) and
          slots in numpy, packed into pinned buffers                          -> `draft_seconds`
  device  forward graph: one copy of the packed inputs, the model over B*N nodes
  host    meanwhile: xgrammar fills one bitmask row per node; pruning in numpy -> `mask_seconds`
  device  tail graph: bitmask copy, masking, argmax per node, copy to pinned memory
  host    the step's one sync; greedy acceptance walked in numpy            -> `wait_seconds`
  device  commit graph: `last_token` for a following plain step, moved slots in the table
  host    pool and table bookkeeping, tokens into the matchers and the streams -> `commit_seconds`
Pruning is not needed for the forward: a live node only attends to its ancestors, which are live,
so pruned nodes never influence what is accepted; the masked argmax never equals a token the
grammar forbids either. Sampled requests (temperature > 0) draw every node's next token on the device
with the plain sampler's noise and walk the path as greedy does (`_sampled_accept`): rejection
sampling for single-token drafts, lossless, and a seeded request emits what plain sampling emits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..pinned import record_on_current_stream
from .chain_step import ChainIO
from .drafter import DraftBatch, Drafter
from .grammar_draft import guided_chain, write_chain
from .policy import MeasuredPolicy
from .tree import HostTrees
from .verify import HostAcceptance, greedy_accept_host
from .verify_step import VerifyIO, VerifyLaunch

if TYPE_CHECKING:  # the engine calls this package, never the other way at import time
    from ..engine.batch import ScheduledBatch
    from ..engine.config import EngineConfig

log = logging.getLogger(__name__)


SPEC_PHASES = ("draft", "mask", "launch", "wait", "commit")  # host phases of a step (module docstring)
# `always`'s brake: plain steps after the drafts' mean acceptance fell below speculative_min_accept
PAUSE_STEPS = 16
# speculative steps that may raise before the engine stops speculating (each one fails its requests;
# speculation only speeds decoding up, so plain decoding is what a drafter's bug leaves)
MAX_FAILED_STEPS = 3


@dataclass
class SpecStats:
    steps: int = 0
    verified_requests: int = 0
    accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    histogram: list = field(default_factory=lambda: [0] * 65)  # accepted drafts per request-step
    forced_draft_tokens: int = 0  # grammar-forced tokens put into drafts
    failed_steps: int = 0  # steps that raised (MAX_FAILED_STEPS of them switch speculation off)
    # host time per phase (seconds, summed over steps; see the module docstring)
    draft_seconds: float = 0.0  # drafting, tree structure, slots, packed inputs
    mask_seconds: float = 0.0  # grammar bitmask rows for every node + pruning (overlaps the forward on CUDA)
    launch_seconds: float = 0.0  # launching the forward and the tail
    wait_seconds: float = 0.0  # waiting for the device and the acceptance walk
    commit_seconds: float = 0.0  # KV bookkeeping, commit launch, emitting the tokens

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per request-step (accepted drafts + the bonus token)."""
        return 1.0 + self.accepted_tokens / max(self.verified_requests, 1)

    def add_phases(self, t0, t1, t2, t3, t4, t5, t6) -> None:
        """A step's clock readings: drafted by t1, forward launched by t2, masks filled by t3,
        tail launched by t4, read back and accepted by t5, committed by t6."""
        self.draft_seconds += t1 - t0
        self.launch_seconds += (t2 - t1) + (t4 - t3)
        self.mask_seconds += t3 - t2
        self.wait_seconds += t5 - t4
        self.commit_seconds += t6 - t5

    def phase_seconds(self) -> dict[str, float]:
        """Host seconds spent in each phase of the speculative steps so far."""
        return {name: getattr(self, f"{name}_seconds") for name in SPEC_PHASES}


def make_drafter(config, runner=None) -> Drafter | None:
    """The configured drafter; `runner` (the engine's model runner) is what an EAGLE head drafts on."""
    algo = config.speculative_algorithm
    if not algo:
        return None
    if algo == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter(num_draft_tokens=config.speculative_num_draft_tokens, branches=config.ngram_branches,
                            max_ngram=config.ngram_max_match, min_ngram=config.ngram_min_match,
                            capacity=config.ngram_capacity)
    if algo == "eagle":
        from ..models.eagle import default_head_dir, load_head
        from .eagle import EagleDrafter
        if runner is None:
            raise ValueError("the EAGLE drafter needs the engine's model runner")
        path = config.eagle_head or default_head_dir(config.model)
        head = load_head(path, runner.mcfg, runner.dtype, runner.device)
        return EagleDrafter(runner, head, num_draft_tokens=config.speculative_num_draft_tokens,
                            topk=config.eagle_topk, depth=config.eagle_depth, capacity=config.speculative_max_batch,
                            masked_depths=config.eagle_masked_depths, fused_chain=config.eagle_fused_chain)
    raise ValueError(f"unknown speculative algorithm {algo!r}; available: ngram, eagle")


class EngineSide(Protocol):
    """What the worker uses of the engine that owns it (a protocol: this package names nothing of
    the engine module, which imports it)."""
    config: EngineConfig
    runner: Any  # the model runner: KV pool and table, graphs, `sample_ahead`
    tokenizer: Any
    masks: Any  # the grammar mask filler (`MaskFiller.fill_chains`, `fill_paths`)
    stats: Any  # `steps`: the engine's step count; `wait_for_device`: its count of the loop's device waits
    grammar_stop_ids: frozenset

    def append_verified(self, req, tokens: list[int]) -> None:
        """The emitted tokens, back through the engine's own token path."""


def _chain_key(req, table: np.ndarray) -> tuple:
    """Where a request is: row, cached length, output length, slot of its last cached position."""
    n = req.num_cached
    return req.row, n, len(req.output_ids), int(table[req.row, n - 1])


def _root_only_trees(B: int, N: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host tree arrays (tokens, next_token, next_sibling [B, N]; num_nodes [B]) of B trees of the
    root alone, for a step's drafts to be written into."""
    return (np.zeros((B, N), np.int64), np.full((B, N), -1, np.int64), np.full((B, N), -1, np.int64),
            np.ones(B, np.int64))


class SpeculativeWorker:
    """The speculative step of the engine that owns it (`EngineSide`)."""

    def __init__(self, engine: EngineSide, drafter: Drafter):
        self.engine = engine
        self.runner = engine.runner
        self.drafter = self._attached(drafter)
        self.width = drafter.num_draft_tokens
        self.stats = SpecStats()
        self._observed: dict[str, int] = {}  # request id -> output tokens already given to the drafter
        self._recent: list[float] = []  # accepted drafts per request-step, recent window (`always`'s brake)
        self._paused_until = 0  # engine step count before which `always` decodes plainly
        self._io: VerifyIO | None = None  # the verify step's static buffers (shared with the graphs)
        self._chain_io: ChainIO | None = None  # the fused chain step's (`chain_step.py`)
        # request id -> ((row, cached length, output length, slot of the last cached position), next
        # chain): the drafts a fused chain step made for the request's next step
        self._chains: dict[str, tuple[tuple, np.ndarray]] = {}
        self.fused_steps = 0
        if engine.config.speculative_policy not in ("measured", "always"):
            raise ValueError(f"speculative_policy must be 'measured' or 'always', not {engine.config.speculative_policy!r}")
        self.policy = self._new_policy()
        self._node_index = np.arange(self.width)
        self._event = torch.cuda.Event() if self.runner.device.type == "cuda" else None

    # -- policy ----------------------------------------------------------------------------------
    def should_speculate(self, batch: ScheduledBatch) -> bool:
        """Plain decoding for batches where speculation loses or cannot run: too large a batch, too
        few free KV slots or context left for a whole tree per request, requests that need
        what verification does not apply (penalties, logit biases, logprobs); then the measured policy's choice
        (a batch size where speculative steps have been slower than plain ones decodes plainly), or
        for `always` a pause while drafts keep failing."""
        if not self._can_speculate(batch):
            if self.policy is not None:
                self.policy.forget_open()
            return False
        if self.policy is None:
            return self._acceptance_holds()
        return self.policy.choose(batch.size, time.perf_counter(), self.engine.stats.steps)

    def _can_speculate(self, batch: ScheduledBatch) -> bool:
        cfg, runner = self.engine.config, self.runner
        if batch.size > cfg.speculative_max_batch or self.stats.failed_steps >= MAX_FAILED_STEPS:
            return False
        if runner.pool.num_free < batch.size * self.width:
            return False
        if any(r.num_cached + self.width > runner.max_context for r in batch.requests):
            return False
        if any(r.params.adjusts_logits or r.params.logprobs is not None for r in batch.requests):
            return False
        return True

    def _acceptance_holds(self) -> bool:
        """The `always` policy's brake: when the recent drafts' mean acceptance falls below
        `speculative_min_accept`, decode plainly for PAUSE_STEPS engine steps, then try again.
        (The measured policy needs none: low acceptance shows in its throughput measurements.)"""
        steps = self.engine.stats.steps
        if steps < self._paused_until:
            return False
        if len(self._recent) >= 32 and sum(self._recent) / len(self._recent) < self.engine.config.speculative_min_accept:
            self._recent = []
            self._paused_until = steps + PAUSE_STEPS
            return False
        return True

    def forget(self, req) -> None:
        self._chains.pop(req.request_id, None)
        if self._observed.pop(req.request_id, None) is not None:
            self.drafter.finish(req.request_id)

    def reset_drafter(self, policy: bool = True) -> None:
        """A fresh drafter that has seen nothing (benchmarks: a run must not draft from the outputs of
        an earlier run of the same prompts), and with `policy` a fresh policy too (a cold start);
        without, the policy keeps its step timings and acceptance, as a server's does after its first
        requests. Call only while no request is running."""
        if self._observed:
            raise RuntimeError("reset_drafter while requests are running")
        self._chains.clear()
        if not self.drafter.reset():  # the EAGLE drafter keeps its head and buffers (graphs read them)
            self.drafter = self._attached(make_drafter(self.engine.config, self.runner))
        if policy:
            self.policy = self._new_policy()

    def _attached(self, drafter: Drafter) -> Drafter:
        """The drafter, given the engine's grammar pool and its count of the loop's device waits."""
        drafter.use_mask_filler(self.engine.masks)
        drafter.wait_for_device = self.engine.stats.wait_for_device
        return drafter

    def _new_policy(self) -> MeasuredPolicy | None:
        return MeasuredPolicy() if self.engine.config.speculative_policy == "measured" else None

    # -- the step --------------------------------------------------------------------------------
    def step(self, batch: ScheduledBatch) -> None:
        """One speculative decode step of the batch. A step that raises fails its requests (the
        engine's doing) and counts: after MAX_FAILED_STEPS the engine decodes plainly."""
        try:
            self._step(batch)
        except Exception:
            self.stats.failed_steps += 1
            if self.stats.failed_steps == MAX_FAILED_STEPS:
                log.error("%d speculative steps failed: speculation is off, the engine decodes plainly "
                          "(the server log has each step's error)", MAX_FAILED_STEPS)
            raise

    @torch.inference_mode()
    def _step(self, batch: ScheduledBatch) -> None:
        reqs = batch.requests
        if self.drafter.fuses_chains and all(r.params.greedy for r in reqs):
            self._chain_step(reqs)
            return
        io = self._verify_io()
        launch = VerifyLaunch(io, self.runner.graphs, len(reqs))
        st = self.stats
        t0 = time.perf_counter()
        trees, filled = self._draft(reqs)
        rows, base, slots = self._take_slots(reqs)
        io.set_inputs(launch.size, rows, base, trees, slots)
        t1 = time.perf_counter()
        logits = launch.forward(self._eager_kv_width(base))
        t2 = time.perf_counter()
        masked = any(r.matcher is not None for r in reqs)
        greedy = all(r.params.greedy for r in reqs)
        if masked:  # on CUDA this CPU work overlaps the forward
            trees = self._mask_trees(reqs, trees, io, filled)
            if not greedy:  # sampled rows are softmaxed whole: give pruned nodes finite rows
                io.bitmask[:len(reqs)][~trees.live] = -1
        t3 = time.perf_counter()
        logits = launch.tail(logits, masked)
        t4 = time.perf_counter()
        if greedy:
            self._sync()  # the step's one wait on the device
            accepted = greedy_accept_host(trees, io.target[:len(reqs)])
        else:
            accepted = self._sampled_accept(reqs, trees, logits)
        t5 = time.perf_counter()
        self._commit(reqs, launch, io, trees, rows, base, slots, accepted)
        t6 = time.perf_counter()
        st.add_phases(t0, t1, t2, t3, t4, t5, t6)

    def _chain_step(self, reqs) -> None:
        """The step of a drafter that drafts top-1 chains after each verify (`chain_step.py`): the
        chains the last step drafted (the drafter's own for requests that have none), their grammar
        rows and pruning while the forward runs, then one launch for the tail, the acceptance and
        the next chains, and one read."""
        io, st = self._verify_io(), self.stats
        chain = self._fused_io()
        launch = VerifyLaunch(io, self.runner.graphs, len(reqs))
        t0 = time.perf_counter()
        trees = self._kept_chains(reqs)
        rows, base, slots = self._take_slots(reqs)
        io.set_inputs(launch.size, rows, base, trees, slots)
        t1 = time.perf_counter()
        kv_width = self._eager_kv_width(base)
        logits = launch.forward(kv_width)
        t2 = time.perf_counter()
        masked = any(r.matcher is not None for r in reqs)
        if masked:  # on CUDA this CPU work overlaps the forward
            trees = self._mask_trees(reqs, trees, io)
        chain.set_live(launch.size, trees.live.sum(1))
        t3 = time.perf_counter()
        launch.chain(logits, masked, chain, kv_width)
        t4 = time.perf_counter()
        self._sync()  # the step's one wait on the device
        accepted = greedy_accept_host(trees, io.target[:len(reqs)])
        lens, drafts = chain.read(len(reqs))
        t5 = time.perf_counter()
        self._commit(reqs, launch, io, trees, rows, base, slots, accepted)
        self._keep(reqs, lens == accepted.accept_lens, drafts)
        t6 = time.perf_counter()
        self.fused_steps += 1
        st.add_phases(t0, t1, t2, t3, t4, t5, t6)

    def _fused_io(self) -> ChainIO:
        if self._chain_io is None:
            graphs = self.runner.graphs
            self._chain_io = graphs.chain_io.get(self.width) if graphs is not None else None
            if self._chain_io is None:
                self._chain_io = ChainIO(self._verify_io(), self.drafter.io)
        return self._chain_io

    def _kept_chains(self, reqs) -> HostTrees:
        """Each request's chain for this step: the one the last fused step drafted, where the
        request is where that step left it; the drafter's own (`propose_arrays`) for the others
        (new requests, or after plain steps or a retraction)."""
        self._observe(reqs)
        B, D = len(reqs), self.drafter.depth
        tokens, next_token, next_sibling, num_nodes = _root_only_trees(B, self.width)
        next_token[:, :D] = np.arange(1, D + 1)  # chains of D drafts
        num_nodes[:] = D + 1
        table, fresh = self.runner.table.host, []
        for b, r in enumerate(reqs):
            kept = self._chains.get(r.request_id)
            if kept is not None and kept[0] == _chain_key(r, table):
                tokens[b, 1:D + 1] = kept[1]
            else:
                fresh.append(b)
        if fresh:
            drafted = self.drafter.propose_arrays(DraftBatch([reqs[b].request_id for b in fresh],
                                                             requests=[reqs[b] for b in fresh]))
            for dst, src in zip((tokens, next_token, next_sibling, num_nodes), drafted):
                dst[fresh] = src
        tokens[:, 0] = [r.output_ids[-1] for r in reqs]
        return HostTrees.build(tokens, next_token, next_sibling, num_nodes)

    def _keep(self, reqs, agreed: np.ndarray, drafts: np.ndarray) -> None:
        """After a fused step's commit: the next chain of each running request, and the drafter's
        note that the head has seen its every cached position. Where the device's acceptance
        disagreed with the host's (it cannot: the same argmax, the same rule), neither: the next
        step drafts afresh and the head reads again from what it had seen."""
        table, running = self.runner.table.host, []
        for b, r in enumerate(reqs):
            self._chains.pop(r.request_id, None)
            if r.finished or not agreed[b]:
                continue
            self._chains[r.request_id] = (_chain_key(r, table), drafts[b].copy())
            running.append(r)
        if not agreed.all():
            log.warning("fused chain step: device and host acceptance disagree for %d requests",
                        int((~agreed).sum()))
        self.drafter.saw(running)

    def _verify_io(self) -> VerifyIO:
        if self._io is None:
            graphs = self.runner.graphs
            self._io = graphs.verify_io.get(self.width) if graphs is not None else None
            if self._io is None:  # eager: CPU, or CUDA graphs off
                cap = min(self.engine.config.speculative_max_batch, self.runner.max_rows)
                self._io = VerifyIO(self.runner, self.width, capacity=cap)
        return self._io

    def _eager_kv_width(self, base: np.ndarray) -> int | None:
        """The slot-table width an eager forward reads: the longest context on the CPU (the torch
        backend's masks scale with it); on CUDA the full width, the same shapes as the graphs."""
        return int(base.max()) + self.width if self.runner.device.type == "cpu" else None

    def _sync(self) -> None:
        if self._event is not None:
            record_on_current_stream(self._event, self.runner.cuda_index)
            self.engine.stats.wait_for_device(self._event.synchronize)

    # -- drafting and grammar masking ------------------------------------------------------------
    def _draft(self, reqs) -> tuple[HostTrees, tuple | None]:
        """The drafter's trees, except grammar-guided chains for requests with a grammar where the
        drafter can rank next tokens for a context (`Drafter.has_next_tokens`); and the rows the
        drafter filled for their nodes (`Drafter.filled_rows`, with the drafted requests' positions),
        or None."""
        self._observe(reqs)
        B, N = len(reqs), self.width
        tokens, next_token, next_sibling, num_nodes = _root_only_trees(B, N)
        guided = self._guided_rows(reqs)
        free = sorted(set(range(B)).difference(guided))
        filled = None
        if free:
            drafted = self.drafter.propose_arrays(DraftBatch(
                [reqs[b].request_id for b in free],
                requests=[reqs[b] for b in free] if self.drafter.needs_requests else None))
            for dst, src in zip((tokens, next_token, next_sibling, num_nodes), drafted):
                dst[free] = src
            known = self.drafter.filled_rows()
            if known is not None:
                filled = (free, *known)
        # node 0 is the model's input for the last sampled token: never take it from a drafter
        tokens[:, 0] = [r.output_ids[-1] for r in reqs]
        k = self.drafter.context_tokens
        for b in guided:
            r = reqs[b]
            tail = r.output_ids[-k:] if len(r.output_ids) >= k else (r.prompt_ids + r.output_ids)[-k:]
            chain, forced = guided_chain(r.matcher, self.engine.tokenizer,
                                         lambda ctx, n, rid=r.request_id: self.drafter.next_tokens(rid, ctx, n),
                                         tail, N - 1)
            write_chain(tokens, next_token, next_sibling, num_nodes, b, chain)
            self.stats.forced_draft_tokens += forced
        return HostTrees.build(tokens, next_token, next_sibling, num_nodes), filled

    def _guided_rows(self, reqs) -> list[int]:
        """The rows drafted as grammar-guided chains: requests with a grammar, where the drafter
        ranks next tokens."""
        if not self.drafter.has_next_tokens:
            return []
        return [b for b, r in enumerate(reqs) if r.matcher is not None]

    def _observe(self, reqs) -> None:
        """Brings each drafter stream up to date: prompt + every emitted token."""
        ids, new_tokens = [], []
        for r in reqs:
            seen = self._observed.get(r.request_id)
            if seen is None:
                if r.params.prediction:
                    self.drafter.add_prediction(r.request_id, r.params.prediction)
                self.drafter.add_request(r.request_id, r.prompt_ids)
                seen = 0
            if seen < len(r.output_ids):
                ids.append(r.request_id)
                new_tokens.append(r.output_ids[seen:])
            self._observed[r.request_id] = len(r.output_ids)
        if ids:
            self.drafter.observe_batch(ids, new_tokens)

    def _mask_trees(self, reqs, trees: HostTrees, io: VerifyIO, filled: tuple | None = None) -> HostTrees:
        """Fills one bitmask row per node into the pinned rows the tail copies, and prunes the nodes
        whose path the grammar forbids. Grammar-guided chains (every token legal) are filled chain
        by chain on the native pool's threads (`MaskFiller.fill_chains`); other trees of requests
        with a grammar (an EAGLE or n-gram tree) node by node, walked depth first on the pool, a
        request's tree on several forks of its matcher when the pool has threads to spare
        (`MaskFiller.fill_paths`), but for the rows the drafter filled already (`filled`: an
        EAGLE tree's root and masked frontiers), which are copied."""
        N = self.width
        rows = self._guided_rows(reqs)
        guided = set(rows)
        chains = trees.is_chain()  # unguided chains (a top-1 drafter's) are walked on the pool too
        unguided, branched = [], []
        for b, r in enumerate(reqs):
            if r.matcher is None:
                io.bitmask[b] = -1  # all tokens allowed (the tail masks the whole batch)
            elif b in guided:
                continue
            elif chains[b]:
                unguided.append(b)
            else:
                branched.append(b)
        if branched:
            known = self._copy_filled_rows(branched, trees, io, filled)
            nodes = [trees.node_paths(b, skip=known.get(b)) for b in branched]
            self.engine.masks.fill_paths([reqs[b].matcher for b in branched], [paths for paths, _ in nodes],
                                         [[b * N + i for i in index] for b, (_, index) in zip(branched, nodes)],
                                         io.bitmask_rows)
        for walked, partial in ((rows, False), (unguided, True)):
            if walked:
                self.engine.masks.fill_chains([reqs[b].matcher for b in walked],
                                              [trees.tokens[b, :trees.num_nodes[b]] for b in walked],
                                              io.bitmask_rows, [b * N for b in walked], self.engine.grammar_stop_ids,
                                              partial)
        return trees.pruned(trees.allowed_by(io.bitmask[:len(reqs)]))

    def _copy_filled_rows(self, branched: list[int], trees: HostTrees, io: VerifyIO, filled) -> dict:
        """Copies the drafter's rows of the branched trees' live nodes into the verify rows (one
        gather); returns {b: [N] bool, the nodes copied}."""
        if filled is None:
            return {}
        free, rows, node_rows = filled
        at = {b: k for k, b in enumerate(free)}
        drafted = [b for b in branched if b in at]
        if not drafted:
            return {}
        src = node_rows[[at[b] for b in drafted]]
        known = (src >= 0) & trees.live[drafted]
        k, node = np.nonzero(known)
        dst = np.asarray(drafted)[k] * self.width + node
        io.bitmask_rows.numpy()[dst] = rows[src[k, node]]  # numpy: torch's indexing took ~7x longer
        return dict(zip(drafted, known))

    # -- verification ----------------------------------------------------------------------------
    def _sampled_accept(self, reqs, trees: HostTrees, logits: torch.Tensor) -> HostAcceptance:
        """Temperature > 0: rejection sampling for point-mass drafts, with the plain sampler's noise.

        Every node's next token is drawn on the device exactly as a plain decode step at that
        node's output position would draw it (same seed, same position counter, same masked and
        filtered distribution), then the path is walked as for greedy: a draft token is accepted
        iff it equals the draw at its parent, and the draw at the last accepted node is the bonus.
        For drafts that are single tokens (every drafter here) this is rejection sampling: a draft
        x is accepted with probability p(x), and after a rejection the draw is distributed as the
        residual p without the rejected tokens, renormalized (siblings included); so the output
        distribution is the target's. It also emits, for a seeded request, the very tokens plain
        sampling emits, whatever was drafted (`verify.rejection_verify` is the general form,
        for drafters that propose distributions)."""
        # a plain step draws with num_cached counting its input token: node d's input is cached at base + d
        ahead = self.runner.sample_ahead(reqs, logits, trees.depth + 1)
        drawn = self.engine.stats.wait_for_device(ahead.cpu).numpy()  # the step's one read-back
        return greedy_accept_host(trees, drawn)

    # -- after verification ----------------------------------------------------------------------
    def _take_slots(self, reqs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One KV slot per node, appended to each request's table row (host copy; the forward
        mirrors them on the device). Returns rows, bases (cached context lengths) and slots [B, N]."""
        runner = self.runner
        B, N = len(reqs), self.width
        rows = np.fromiter((r.row for r in reqs), np.int64, B)
        base = np.fromiter((r.num_cached for r in reqs), np.int64, B)
        slots = runner.pool.alloc(B * N).reshape(B, N)
        runner.table.host[rows[:, None], base[:, None] + self._node_index] = slots
        runner.table.lengths[rows] = base + N
        return rows, base, slots

    def _commit(self, reqs, launch: VerifyLaunch, io: VerifyIO, trees: HostTrees, rows, base, slots,
                accepted: HostAcceptance) -> None:
        """Keeps the accepted path's K/V in consecutive table columns, frees the other slots, hands
        the bonus tokens to the next step, and emits the tokens."""
        runner, table = self.runner, self.runner.table
        lens, path = accepted.accept_lens, accepted.accepted_nodes
        on_path = path >= 0  # [B, depth]
        path_slots = np.take_along_axis(slots, np.maximum(path, 0), 1)  # slot of the accepted node at each depth
        mb, md = np.nonzero(on_path & (path != self._node_index))  # accepted nodes off their column
        columns = base[mb] + md
        table.host[rows[mb], columns] = path_slots[mb, md]
        table.lengths[rows] = base + lens + 1
        kept = np.zeros(slots.shape, bool)
        kept[np.nonzero(on_path)[0], path[on_path]] = True
        runner.pool.free(slots[~kept])
        io.set_commit(launch.size, rows, accepted.bonus_tokens, rows[mb] * table.max_context + columns,
                      path_slots[mb, md])
        launch.commit()
        self._count(reqs, base, lens)
        emitted = accepted.emitted_tokens(trees.tokens)
        for b, r in enumerate(reqs):  # after the bookkeeping: a request that finishes here releases its row
            self.engine.append_verified(r, emitted[b, :lens[b] + 1].tolist())

    def _count(self, reqs, base, lens) -> None:
        st = self.stats
        accepted = lens.tolist()
        for r, b, n in zip(reqs, base.tolist(), accepted):
            r.num_cached = b + n + 1  # root + accepted drafts; the bonus is the next step's root
            r.spec_steps += 1
            r.spec_accepted += n
            st.histogram[min(n, 64)] += 1
        st.steps += 1
        st.verified_requests += len(reqs)
        st.accepted_tokens += sum(accepted)
        if self.policy is not None:
            self.policy.add_tokens(len(reqs) + sum(accepted))
        else:
            self._recent = (self._recent + accepted)[-256:]
