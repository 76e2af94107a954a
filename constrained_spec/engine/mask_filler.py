"""Grammar bitmask rows for one step, optionally within a time budget ("bounded mask latency").

Every fill runs on the native pool (`grammar/native_fill.py`): persistent C++ threads that call
xgrammar without the GIL. Without a budget a step's rows are one job on the pool, a thread per
NATIVE_ROWS_PER_THREAD rows beside the calling thread; in the overlapped loop the job also carries
the step before's token accepts and runs while the engine thread streams (`start`, then
`StartedFill.finish`). From `start` until `finish` returns, the rows' matchers and bitmask rows
belong to the job; no other thread may call them (not even `is_terminated`). A speculative step's
draft rows are walks (`grammar/walks.py`: draft chains, and `fill_paths` for trees and EAGLE
frontiers, on forks of a request's matcher when the pool has threads to spare; without, a request's
paths are walked on the calling thread, cheaper than the pool's set-up for one walk).

Rows of llguidance matchers (`grammar/llguidance_backend.py`) are llguidance's: its own GIL-free
parallel fill (`LLGuidanceFill`, one call per step, started from its own thread beside the pool's job
for the xgrammar rows), its accepts on the engine thread (a refused token leaves an llguidance
matcher as it was only through its Python wrapper). With a budget they are filled within the step,
never late.

With a budget (`grammar_mask_budget_ms`) every row is queued on the pool on its own, into a staging
row, and the engine thread waits until all rows are in or the budget is spent. Requests whose rows
are missing are *late*: they sit this step out (their sample is void and the step is repeated for
them, see `ModelRunner.sample`) while their fill runs on and serves their next step; a late
request's matcher does not move in between, so the row is still the right one. Staging rows belong
to their fill, never to the step's bitmask: a late fill must not write into a buffer that the next
step has laid out differently. The engine thread gathers the finished rows in one copy.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..grammar.llguidance_backend import NAME as LLGUIDANCE, LLGuidanceFill
from ..grammar.native_fill import NativeFill
from ..grammar.walks import WalkSteps, sorted_paths, split_paths, walk_paths_here
from .config import EngineConfig
from .request import Status

_FINISHED = Status.FINISHED

# Rows per pool thread for a step's fill (benchmarks/bench_mask_fill.py, H100 host: 2 rows a thread
# fastest at batch 32 and 64, as fast as 4 at 128).
NATIVE_ROWS_PER_THREAD = 2
# Tokens accepted per pool thread (an accept costs about what a cheap fill does).
ACCEPT_ROWS_PER_THREAD = 8
# Draft chains per pool thread (`fill_chains`; a chain is up to ~8 fills and accepts).
CHAINS_PER_THREAD = 2
# A request whose last fill took more than this share of the budget is queued after the others, so
# that the rows that can still make it are not stuck behind it.
SLOW_SHARE = 0.5
# Pool threads beyond `threads` with a budget, to stand in for threads held by late fills.
EXTRA_BUDGET_THREADS = 8
# A started fill (`MaskFiller.start`) of fewer rows is not worth the engine's hand-over of the step's
# Python work (a thread wake-up at each end, some 20-60 us each).
BACKGROUND_MIN_ROWS = 4


@dataclass
class MaskFill:
    """The bitmask of a step and the rows that missed the budget."""
    bitmask: torch.Tensor | None  # rows [:n] of the pinned host buffer; None: nothing is constrained
    late: list[int] = field(default_factory=list)  # positions among the requests passed to `fill`


class _Job:
    """One request's next-token row, queued on the pool into staging row `slot`."""
    __slots__ = ("req", "matcher", "slot")

    def __init__(self, req, slot: int):
        self.req = req
        self.matcher = req.matcher  # read here, on the engine thread; kept alive until the row is done
        self.slot = slot


class StartedFill:
    """A fill started by `MaskFiller.start`, running on the pool's threads. `finish()` waits for
    it (it never raises: `MaskFiller.fill` raises what it raised). `refused`: once finished, the
    (request, token) pairs among `start`'s accepts whose token the grammar refused (their matchers
    are as they were)."""
    __slots__ = ("reqs", "done", "error", "refused", "_finish")

    def __init__(self, reqs: list, finish: Callable[[], list]):
        self.reqs = reqs
        self.done = False
        self.error: Exception | None = None
        self.refused: list = []
        self._finish = finish

    def finish(self) -> None:
        if self.done:
            return
        try:
            self.refused = self._finish()
        except Exception as e:  # noqa: BLE001 - raised by `MaskFiller.fill`, on the engine thread
            self.error = e
        self.done = True


class MaskFiller:
    """Fills the grammar bitmask rows of a step into `bitmask` (the runner's pinned host buffer).

    Requests carry `mask_job` (a budgeted fill still queued or running) and `mask_fill_seconds`
    (how long their last budgeted fill took)."""

    def __init__(self, bitmask: torch.Tensor, threads: int, budget_ms: float | None, max_requests: int,
                 stop_ids: frozenset = frozenset(),
                 paths_per_walk: int = EngineConfig.grammar_paths_per_walk):
        self._bitmask = bitmask
        self.stop_ids = stop_ids  # the grammars' stop tokens: no row is filled after one (`fill_paths`)
        # `fill_paths` cuts a request's draft paths into walks of this many or more, each on its own
        # fork of the matcher, while the pool has threads for them (`EngineConfig.grammar_paths_per_walk`)
        self.paths_per_walk = max(1, paths_per_walk)
        self.budget_s = budget_ms / 1000.0 if budget_ms else None
        helpers = max(0, threads - 1)  # the caller's thread fills too
        workers = helpers if self.budget_s is None else max(2, threads) + EXTRA_BUDGET_THREADS
        self._native = NativeFill.create(workers, max_helpers=helpers)
        # One staging row per budgeted fill; late fills of finished requests may briefly hold a row
        # each, hence the room beyond one per request. The last row stays all-ones (rows nobody
        # constrains).
        capacity = 2 * max_requests
        self._staging = torch.full((capacity + 1, bitmask.shape[1]), -1, dtype=torch.int32)
        self._ones_row = capacity
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._staged = self._native.staged_rows(self._staging) if self.budget_s is not None else None
        self._outstanding: set[_Job] = set()  # budgeted fills whose row has not been used yet
        self._started: StartedFill | None = None
        self._llg_threads = max(1, threads)
        self._llg: LLGuidanceFill | None = None  # built with the first llguidance row

    def _llguidance(self) -> LLGuidanceFill:
        if self._llg is None:
            self._llg = LLGuidanceFill(self._llg_threads)
        return self._llg

    # -- the step --------------------------------------------------------------------------------
    def start(self, reqs: Sequence, accept_reqs: Sequence = (), accept_tokens: Sequence[int] = ()
              ) -> StartedFill | None:
        """Starts the fill of a step whose sampling requests are `reqs` (in this order) on the pool
        and returns it; None when there are fewer than BACKGROUND_MIN_ROWS rows to fill, or with a
        budget (its rows are queued one by one anyway). accept_reqs[i] takes accept_tokens[i] first
        (the step before's tokens; a request's before its row is filled); with None returned, the
        caller accepts them. The caller finishes it before the step samples; `fill(reqs)` then
        returns the rows or raises what the fill raised. Call `start` only once the device has read
        the previous step's bitmask (the engine waits for its tokens first) and every matcher has
        the tokens not among the accepts. From here until `finish` returns, the rows' matchers are
        the fill's (module docstring)."""
        if self.budget_s is not None or self._started is not None:
            return None
        live = [i for i, r in enumerate(reqs)  # _needs_row, inlined (every step, every request)
                if r.matcher is not None and not r.discard_inflight and r.status is not _FINISHED]
        if len(live) < BACKGROUND_MIN_ROWS:
            return None
        self.settle(reqs)  # fills left from a budgeted step (the budget was switched off since)
        bitmask = self._bitmask[:len(reqs)]
        if len(live) < len(reqs):
            _allow_all(bitmask, sorted(set(range(len(reqs))).difference(live)))
        llg_rows = [i for i in live if reqs[i].matcher.backend == LLGUIDANCE]
        if not llg_rows and not any(r.matcher.backend == LLGUIDANCE for r in accept_reqs):
            self._started = StartedFill(reqs, self._start_on_pool(reqs, live, accept_reqs, accept_tokens, bitmask))
            return self._started
        # llguidance rows: their accepts here, their fill started beside the pool's (llguidance's own call)
        live = [i for i in live if reqs[i].matcher.backend != LLGUIDANCE]
        pairs = list(zip(accept_reqs, accept_tokens))
        refused = [(r, t) for r, t in pairs if r.matcher.backend == LLGUIDANCE and not r.matcher.accept_token(t)]
        rest = [(r, t) for r, t in pairs if r.matcher.backend != LLGUIDANCE]
        llg = self._llguidance().start([reqs[i].matcher for i in llg_rows], bitmask, llg_rows) if llg_rows else None
        pool_finish = (self._start_on_pool(reqs, live, [r for r, _ in rest], [t for _, t in rest], bitmask)
                       if live or rest else list)

        def finish() -> list:
            try:
                out = pool_finish()
            finally:
                if llg is not None:
                    llg.result()
            return out + refused
        self._started = StartedFill(reqs, finish)
        return self._started

    def _start_on_pool(self, reqs: Sequence, live: list[int], accept_reqs: Sequence, accept_tokens: Sequence[int],
                       bitmask) -> Callable[[], list]:
        """One job on the pool: each live row's request accepts its token (if it has one among the
        accepts), then fills its row; the accepting requests without a row only accept."""
        entries = reqs if len(live) == len(reqs) else [reqs[i] for i in live]
        rows, tokens = live, None
        if len(accept_reqs) == len(entries) and all(map(operator.is_, accept_reqs, entries)):
            tokens = accept_tokens  # the usual step: the same requests as the step before, in order
        elif accept_reqs:
            token_of = {id(r): t for r, t in zip(accept_reqs, accept_tokens)}
            tokens = [token_of.pop(id(r), -1) for r in entries]
            if token_of:  # requests not sampling this step (finished meanwhile, or held back)
                rest = [(r, t) for r, t in zip(accept_reqs, accept_tokens) if id(r) in token_of]
                entries = [*entries, *(r for r, _ in rest)]  # (never `reqs` itself, which is the caller's)
                tokens += [t for _, t in rest]
                rows = live + [-1] * len(rest)
        running = self._native.prepare([r.matcher for r in entries], bitmask, rows, tokens)
        running.start(max(1, self._native.helpers_for(len(entries), NATIVE_ROWS_PER_THREAD)))

        def finish() -> list:
            running.finish()
            return [(entries[j], tokens[j]) for j in running.refused()]
        return finish

    def cancel(self) -> None:
        """Drops a started fill (the step it was for will not sample: an engine step failed), once it
        is done."""
        if self._started is not None:
            self._started.finish()
        self._started = None

    def fill(self, reqs: Sequence) -> MaskFill:
        """Rows for the requests that sample this step (in this order). Rows that need no mask
        (no grammar, finished, or a sample that will be discarded anyway) allow every token."""
        if self._started is not None:
            started, self._started = self._started, None
            started.finish()  # done already when the engine finished it (a no-op then)
            if started.error is not None:
                raise started.error
            if started.reqs is reqs or (len(started.reqs) == len(reqs)
                                        and all(map(operator.is_, started.reqs, reqs))):
                return MaskFill(self._bitmask[:len(reqs)])
            # for other requests (not expected): fill anew
        if not any(r.matcher is not None for r in reqs):
            return MaskFill(None)
        bitmask = self._bitmask[:len(reqs)]
        if self.budget_s is None:
            self._fill_now(reqs, bitmask)
            return MaskFill(bitmask)
        late = self._fill_within(reqs, bitmask, time.perf_counter() + self.budget_s)
        return MaskFill(bitmask, late)

    def settle(self, reqs: Sequence) -> None:
        """Waits for the fills still running for these requests and drops their rows: the caller is
        about to move their matchers (the speculative step drafts and accepts on them)."""
        self.cancel()
        if not self._outstanding:
            return
        jobs = [r.mask_job for r in reqs if r.mask_job is not None]
        if jobs:
            self._staged.wait([job.slot for job in jobs], None)
            for job in jobs:
                self._release(job)

    def close(self) -> None:
        self.cancel()
        if self._outstanding:  # queued fills hold matchers: let them end before the pool goes
            self._staged.wait([job.slot for job in self._outstanding], None)
        self._native = None  # its threads are joined as the pool goes

    def accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[int]:
        """matchers[i] accepts tokens[i] on the pool (a thread per ACCEPT_ROWS_PER_THREAD rows);
        returns the positions whose token was refused (those matchers are unchanged). llguidance
        matchers accept here."""
        llg = [j for j, m in enumerate(matchers) if m.backend == LLGUIDANCE]
        if not llg:
            return self._native.accept(matchers, tokens,
                                       self._native.helpers_for(len(matchers), ACCEPT_ROWS_PER_THREAD))
        refused = [j for j in llg if not matchers[j].accept_token(tokens[j])]
        pool = [j for j, m in enumerate(matchers) if m.backend != LLGUIDANCE]
        if pool:
            refused += [pool[j] for j in self._native.accept(
                [matchers[j] for j in pool], [tokens[j] for j in pool],
                self._native.helpers_for(len(pool), ACCEPT_ROWS_PER_THREAD))]
        return sorted(refused)

    # -- a speculative step's draft chains -------------------------------------------------------
    def fill_chains(self, matchers: Sequence, chains: Sequence[Sequence[int]], bitmask: torch.Tensor,
                    first_rows: Sequence[int], stop_ids: frozenset, partial: bool = False) -> None:
        """A speculative step's rows for draft chains, a chain per pool thread at a time (a thread per
        CHAINS_PER_THREAD chains); llguidance's chains in one llguidance call. Raises if a chain
        token was refused, unless `partial` (drafts the grammar did not guide): then a chain's rows
        stop before its first refused token, and the rows after are left as they were (the
        worker's pruning never trusts them: the refused node is not in its parent's row)."""
        llg = [j for j, m in enumerate(matchers) if m.backend == LLGUIDANCE]
        if llg:
            self._llguidance().fill_chains([matchers[j] for j in llg], [chains[j] for j in llg], bitmask,
                                           [first_rows[j] for j in llg], partial)
            pool = [j for j, m in enumerate(matchers) if m.backend != LLGUIDANCE]
            matchers, chains, first_rows = ([matchers[j] for j in pool], [chains[j] for j in pool],
                                            [first_rows[j] for j in pool])
        if not matchers:
            return
        helpers = self._native.helpers_for(len(chains), CHAINS_PER_THREAD)
        self._native.chains_call(matchers, chains, bitmask, first_rows, stop_ids, helpers, partial)()

    def fill_paths(self, matchers: Sequence, paths: Sequence[Sequence[Sequence[int]]],
                   rows: Sequence[Sequence[int]], bitmask: torch.Tensor) -> None:
        """Draft nodes' rows (`grammar/walks.py`): row rows[i][j] holds the tokens legal after
        matchers[i] accepts paths[i][j] (the tokens from where it stands to the node), none where
        the path is illegal or ends on a stop token; every matcher ends where it was. A request's
        paths are cut into walks on forks of its matcher while the pool has threads to spare (an
        EAGLE frontier at batch 1: 8 paths of one matcher); llguidance's are walked here."""
        threads = self._native.max_helpers + 1
        per_request = threads // max(1, len(matchers))
        walkers, steps = [], WalkSteps()
        for m, node_paths, node_rows in zip(matchers, paths, rows):
            node_paths, node_rows = self._cut_at_stops(node_paths, node_rows, bitmask)
            parts = min(per_request, len(node_paths) // self.paths_per_walk)
            if m.backend == LLGUIDANCE or (parts < 2 and per_request < 2):
                # on this thread: with no threads to spare the pool's only gain is the Python around
                # xgrammar's calls, less than building its steps (CPU, 1 thread)
                walk_paths_here(m, node_paths, node_rows, bitmask)
                continue
            runs = split_paths(sorted_paths(node_paths), parts)
            for k, order in enumerate(runs):
                walkers.append(m if k == 0 else m.fork())
                steps.add_paths(node_paths, node_rows, order, m.never_accepts)
                steps.end_walk()
        if walkers:
            self._native.walk_call(walkers, steps.walks(), bitmask, self._native.helpers_for(len(walkers), 1))()

    def _cut_at_stops(self, paths, rows, bitmask: torch.Tensor) -> tuple[Sequence, Sequence[int]]:
        """A matcher that took a stop token has ended: a path ending on one fills no row (-1), and
        the paths that go on past one (a draft tree's nodes under a stop token) are not walked at
        all (xgrammar warned of each token a terminated matcher was asked to accept); their rows
        are zeroed here. A tree holds each node's own path, so those are the paths that start with
        one ending on a stop."""
        ends = [j for j, p in enumerate(paths) if len(p) and p[-1] in self.stop_ids]
        if not ends:
            return paths, rows
        stems = {tuple(paths[j]) for j in ends}
        lengths = {len(stem) for stem in stems}
        kept_paths, kept_rows = [], []
        for path, row in zip(paths, rows):
            past = len(path) > min(lengths) and any(tuple(path[:n]) in stems for n in lengths if n < len(path))
            if past or (len(path) and path[-1] in self.stop_ids):
                if row >= 0:
                    bitmask[row] = 0
                if past:
                    continue
                row = -1
            kept_paths.append(path)
            kept_rows.append(row)
        return kept_paths, kept_rows

    # -- without a budget -------------------------------------------------------------------------
    def _fill_now(self, reqs: Sequence, bitmask: torch.Tensor) -> None:
        self.settle(reqs)  # fills left from a budgeted step (the budget was switched off since)
        live = [i for i, r in enumerate(reqs) if _needs_row(r)]
        if len(live) < len(reqs):
            _allow_all(bitmask, [i for i, r in enumerate(reqs) if not _needs_row(r)])
        llg = [i for i in live if reqs[i].matcher.backend == LLGUIDANCE]
        if llg:
            self._llguidance().fill([reqs[i].matcher for i in llg], bitmask, llg)
            live = [i for i in live if reqs[i].matcher.backend != LLGUIDANCE]
        if live:
            self._native.prepare([reqs[i].matcher for i in live], bitmask, live).run(
                self._native.helpers_for(len(live), NATIVE_ROWS_PER_THREAD))

    # -- within a budget: queued rows -------------------------------------------------------------
    def _fill_within(self, reqs: Sequence, bitmask: torch.Tensor, deadline: float) -> list[int]:
        self._drop_orphans()
        placed: list[tuple[int, _Job]] = []  # (position, job) for every row a matcher fills
        late: list[int] = []
        fresh: list[_Job] = []
        llg: list[int] = []  # filled within the step, after the gather
        for i, r in enumerate(reqs):
            if not _needs_row(r):
                continue
            if r.matcher.backend == LLGUIDANCE:
                llg.append(i)
                continue
            job = r.mask_job
            if job is None:
                job = self._new_job(r)
                if job is None:  # no staging row free: try again next step
                    late.append(i)
                    continue
                fresh.append(job)
            placed.append((i, job))
        if fresh:
            fresh = self._slow_last(fresh)
            self._staged.submit([job.matcher for job in fresh], [job.slot for job in fresh])
        done = self._staged.wait([job.slot for _, job in placed], deadline - time.perf_counter())
        sources = [self._ones_row] * len(reqs)
        for (i, job), ok in zip(placed, done):
            if ok:
                sources[i] = job.slot
            else:
                late.append(i)
        torch.index_select(self._staging, 0, torch.tensor(sources), out=bitmask)
        if llg:
            self._llguidance().fill([reqs[i].matcher for i in llg], bitmask, llg)
        for (_, job), ok in zip(placed, done):
            if ok:
                self._release(job)
        return sorted(late)

    def _new_job(self, req) -> _Job | None:
        if not self._free_slots:
            return None
        job = _Job(req, self._free_slots.pop())
        req.mask_job = job
        self._outstanding.add(job)
        return job

    def _slow_last(self, jobs: list[_Job]) -> list[_Job]:
        slow = SLOW_SHARE * self.budget_s
        return sorted(jobs, key=lambda j: j.req.mask_fill_seconds > slow)  # stable: batch order otherwise

    def _release(self, job: _Job) -> None:
        """The job's row has been used (or dropped): its staging row goes back, the request learns
        how long its fill took."""
        job.req.mask_job = None
        job.req.mask_fill_seconds = float(self._staged.seconds[job.slot])
        self._outstanding.discard(job)
        self._free_slots.append(job.slot)

    def _drop_orphans(self) -> None:
        """Gives back the staging rows of late fills whose request finished in the meantime."""
        for job in [j for j in self._outstanding if j.req.finished and self._staged.done[j.slot]]:
            self._release(job)


def _needs_row(req) -> bool:
    return req.matcher is not None and not req.finished and not req.discard_inflight


def _allow_all(bitmask: torch.Tensor, rows: list[int]) -> None:
    if len(rows) == 1:
        bitmask[rows[0]].fill_(-1)
    else:
        bitmask.index_fill_(0, torch.tensor(rows), -1)
