"""Grammar bitmask rows for one step, optionally within a time budget ("bounded mask latency").

Without a budget the rows are filled on the engine thread's behalf: one
`GrammarMatcher.fill_next_token_bitmask` per row for small batches (up to DIRECT_FILL_MAX_ROWS), one
GIL-free call for larger ones, on the native pool's persistent threads (`grammar/native_fill.py`: a
thread per NATIVE_ROWS_PER_THREAD rows, up to `threads`; the step's token accepts go through it
too). Where the pool cannot be built (another xgrammar layout) xgrammar's `BatchGrammarMatcher`
does the work, a thread per ROWS_PER_THREAD rows. The pool is the default because the batch
matcher starts and joins its threads in every call (~40-75 us each) and accepts on one thread: 128
rows of real JSON states fill in 0.11 ms on the pool against 0.52-0.96 ms on the batch matcher at
1-14 threads (H100 host, `benchmarks/bench_mask_fill.py`; docs/performance.md).
Only the rows no matcher writes are set to all-ones: xgrammar writes every word of a row it fills
(tests/test_mask_latency.py checks it).

Started fills (`start`, the overlapped loop without a budget): `start` starts the fill of the step
already on the device and returns it (`StartedFill`). On the native pool it runs on the pool's
threads from there, while the engine thread finishes and streams the requests of the step before,
then waits for it (`StartedFill.finish`). Without the pool it is one call into xgrammar that the
engine makes on its own thread while its step thread does that work (`engine.py`): xgrammar
releases the GIL inside the call, and the call's arguments are converted in `start`, so the call
drops the GIL at once and the step thread, waking meanwhile, finds it free. `fill` then hands out
the rows. Ownership: from `start` until `finish` returns, the matchers of its rows and the step's
bitmask rows belong to the fill; no other thread may call them (not even `is_terminated`: a fill
moves a matcher's state and rolls it back). A row whose request finishes in the meantime is filled
anyway and unused (its sample is discarded).

With a budget (`grammar_mask_budget_ms`) every row is a job for worker threads. They run in
parallel with the engine thread because xgrammar's fill releases the GIL (measured: a thread looping
over 9.5 ms fills leaves the engine thread's sleep(0) latency at 0.06 ms). The engine thread waits
until all rows are in or the budget is spent. Requests whose rows are still missing are *late*: they
sit this step out (their sample is void and the step is repeated for them, see
`ModelRunner.sample`) while their fill runs on and serves their next step; their matcher does not
move in between (a late request accepts no token), so the row is still the right one. Workers write
into staging rows that belong to their job, never into the step's bitmask: a late job must not
write into a buffer that the next step has laid out differently. The engine thread copies the
finished rows over in one gather.
"""
from __future__ import annotations

import operator
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch
import xgrammar as xgr

from ..grammar.backend import batch_accept, batch_fill_call, chain_fill_call
from ..grammar.native_fill import NativeFill
from .request import Status

_FINISHED = Status.FINISHED

# Up to this many rows a plain loop on the engine thread costs no more than the batch matcher's call.
DIRECT_FILL_MAX_ROWS = 8
# Rows per thread of the batch matcher (host time per step at batch 32-128 fell with up to 8 threads).
ROWS_PER_THREAD = 8
# Rows per thread of the native pool, whose threads are waiting (benchmarks/bench_mask_fill.py, H100
# host: 2 rows a thread fastest at batch 32 and 64, as fast as 4 at 128).
NATIVE_ROWS_PER_THREAD = 2
# Tokens accepted per thread of the native pool (an accept costs about what a cheap fill does).
ACCEPT_ROWS_PER_THREAD = 8
# Draft chains per thread of the native pool (`fill_chains`; a chain is up to ~8 fills and accepts).
CHAINS_PER_THREAD = 2
# A request whose last fill took more than this share of the budget is queued after the others, so
# that with few workers the rows that can still make it are not stuck behind it.
SLOW_SHARE = 0.5
# Workers started beyond `threads` to stand in for workers held by late fills (one per late fill).
MAX_EXTRA_WORKERS = 32
# A started fill (`MaskFiller.start`) of fewer rows is not worth the engine's hand-over of the step's
# Python work to its step thread (a thread wake-up at each end, some 20-60 us each).
BACKGROUND_MIN_ROWS = 4


@dataclass
class MaskFill:
    """The bitmask of a step and the rows that missed the budget."""
    bitmask: torch.Tensor | None  # rows [:n] of the pinned host buffer; None: nothing is constrained
    late: list[int] = field(default_factory=list)  # positions among the requests passed to `fill`


class _Waiter:
    """The engine thread's wait for the jobs of one step."""
    __slots__ = ("remaining", "event")

    def __init__(self):
        self.remaining = 0
        self.event = threading.Event()


class _Job:
    """One request's next-token row, filled by a worker into a staging row."""
    __slots__ = ("req", "matcher", "slot", "seconds", "done", "waiter")

    def __init__(self, req, slot: int):
        self.req = req
        self.matcher = req.matcher  # read here, on the engine thread
        self.slot = slot
        self.seconds = 0.0
        self.done = False
        self.waiter: _Waiter | None = None


class _Workers:
    """Threads that fill jobs. Each submission finds `threads` workers free for it: a worker held
    by a late fill does not count, so a slow request delays its own row and no one else's."""

    def __init__(self, threads: int, staging: torch.Tensor, lock: threading.Lock):
        self.threads = threads
        self._staging = staging
        self._lock = lock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self.unfinished = 0  # jobs submitted and not done (guarded by the lock)

    def submit(self, jobs: list[_Job]) -> None:
        with self._lock:
            held = self.unfinished
            self.unfinished += len(jobs)
        wanted = min(self.threads + held, self.threads + MAX_EXTRA_WORKERS)
        while len(self._workers) < wanted:
            t = threading.Thread(target=self._run, name=f"grammar-mask-{len(self._workers)}", daemon=True)
            t.start()
            self._workers.append(t)
        for job in jobs:
            self._queue.put(job)

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(timeout=5)
        self._workers.clear()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                job.matcher.fill_bitmask(self._staging, job.slot)
            except Exception:  # noqa: BLE001 - a broken row is an all-ones row, not a dead worker
                self._staging[job.slot].fill_(-1)
            seconds = time.perf_counter() - t0
            with self._lock:
                job.seconds, job.done = seconds, True
                self.unfinished -= 1
                waiter = job.waiter
                if waiter is not None:
                    waiter.remaining -= 1
                    if waiter.remaining == 0:
                        waiter.event.set()


class StartedFill:
    """A fill prepared by `MaskFiller.start`. `finish()` makes it or waits for it (it never raises:
    `MaskFiller.fill` raises what it raised). `on_threads`: it runs on the native pool's threads
    from `start` on, so the caller's thread is free meanwhile; otherwise `finish` is the whole
    call, which drops the GIL at once (a thread of the caller's may run Python beside it).
    `refused`: once finished, the (request, token) pairs among `start`'s accepts whose token the
    grammar refused (their matchers are as they were)."""
    __slots__ = ("reqs", "done", "error", "on_threads", "refused", "_finish")

    def __init__(self, reqs: list, finish: Callable[[], list], on_threads: bool):
        self.reqs = reqs
        self.done = False
        self.error: Exception | None = None
        self.on_threads = on_threads
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

    Requests carry `mask_job` (a fill still running off the engine thread) and `mask_fill_seconds`
    (how long their last off-thread fill took)."""

    def __init__(self, bitmask: torch.Tensor, threads: int, budget_ms: float | None, max_requests: int):
        self._bitmask = bitmask
        self._threads = threads
        self._native = NativeFill.create(max(0, threads - 1))  # the caller's thread fills too
        self._batch: dict[int, xgr.BatchGrammarMatcher] = {}  # threads -> batch matcher, without it
        self._one_thread: xgr.BatchGrammarMatcher | None = None  # `fill_chains` without the native pool
        self.budget_s = budget_ms / 1000.0 if budget_ms else None
        # One staging row per job; late jobs of finished requests may briefly hold a row each, hence
        # the room beyond one per request. The last row stays all-ones (rows nobody constrains).
        capacity = 2 * max_requests
        self._staging = torch.full((capacity + 1, bitmask.shape[1]), -1, dtype=torch.int32)
        self._ones_row = capacity
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self._workers = _Workers(max(2, threads), self._staging, self._lock)
        self._outstanding: set[_Job] = set()  # jobs whose row has not been used yet
        self._started: StartedFill | None = None

    # -- the step --------------------------------------------------------------------------------
    def start(self, reqs: Sequence, accept_reqs: Sequence = (), accept_tokens: Sequence[int] = ()
              ) -> StartedFill | None:
        """Prepares the fill of a step whose sampling requests are `reqs` (in this order) and returns
        it; None when there are fewer than BACKGROUND_MIN_ROWS rows to fill, or with a budget (its
        per-row jobs run on workers anyway). accept_reqs[i] takes accept_tokens[i] first (the step
        before's tokens; a request's before its row is filled); with None returned, the caller
        accepts them. On the native pool the accepts and the fill start at once on its threads;
        else the accepts are made here and the fill is one call into xgrammar that `finish` makes.
        The caller finishes it before the step samples; `fill(reqs)` then returns the rows or
        raises what the fill raised. Call `start` only once the device has read the previous step's
        bitmask (the engine waits for its tokens first) and every matcher has the tokens not among
        the accepts. From here until `finish` returns, the rows' matchers are the fill's (module
        docstring)."""
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
        if self._native is not None:  # the accepts ride along in the fill's job, each before its row
            started = self._start_on_pool(reqs, live, accept_reqs, accept_tokens, bitmask)
        else:
            refused = self._accept_now(accept_reqs, accept_tokens)
            fill = self._fill_call([reqs[i].matcher for i in live], bitmask, live)

            def finish() -> list:
                fill()
                return refused
            started = StartedFill(reqs, finish, on_threads=False)
        self._started = started
        return started

    def _start_on_pool(self, reqs: Sequence, live: list[int], accept_reqs: Sequence, accept_tokens: Sequence[int],
                       bitmask) -> StartedFill:
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
        return StartedFill(reqs, finish, on_threads=True)

    def _accept_now(self, accept_reqs: Sequence, accept_tokens: Sequence[int]) -> list:
        if not accept_reqs:
            return []
        refused = self.accept([r.matcher for r in accept_reqs], accept_tokens)
        return [(accept_reqs[j], accept_tokens[j]) for j in refused]

    def cancel(self) -> None:
        """Drops a started fill (the step it was for will not sample: an engine step failed), once it
        is done: a fill still running on the pool's threads is waited for."""
        if self._started is not None and self._started.on_threads:
            self._started.finish()
        self._started = None

    def fill(self, reqs: Sequence) -> MaskFill:
        """Rows for the requests that sample this step (in this order). Rows that need no mask
        (no grammar, finished, or a sample that will be discarded anyway) allow every token."""
        if self._started is not None:
            started, self._started = self._started, None
            if started.on_threads:
                started.finish()  # done already when the engine finished it (a no-op then)
            if started.done:
                if started.error is not None:
                    raise started.error
                if started.reqs is reqs or (len(started.reqs) == len(reqs)
                                            and all(map(operator.is_, started.reqs, reqs))):
                    return MaskFill(self._bitmask[:len(reqs)])
            # not made, or for other requests (neither is expected): fill anew
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
            self._wait(jobs, deadline=None)
            for job in jobs:
                self._release(job)

    def close(self) -> None:
        self.cancel()
        self._native = None  # its threads are joined as the pool goes
        self._workers.close()

    def accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[int]:
        """matchers[i] accepts tokens[i]; returns the positions whose token was refused (those
        matchers are unchanged). On the native pool's threads (a thread per ACCEPT_ROWS_PER_THREAD
        rows), else in one xgrammar call on this thread."""
        if self._native is None:
            return batch_accept(matchers, tokens)
        return self._native.accept(matchers, tokens, self._native.helpers_for(len(matchers), ACCEPT_ROWS_PER_THREAD))

    # -- a speculative step's draft chains -------------------------------------------------------
    def fill_chains(self, matchers: Sequence, chains: Sequence[Sequence[int]], bitmask: torch.Tensor,
                    first_rows: Sequence[int], stop_ids: frozenset) -> None:
        """A speculative step's rows for grammar-guided draft chains: on the native pool, a chain per
        thread at a time (a thread per CHAINS_PER_THREAD chains); else depth by depth in xgrammar
        calls on this thread (`backend.chain_fill_call`). Raises if a chain token was refused."""
        if self._native is not None:
            helpers = self._native.helpers_for(len(chains), CHAINS_PER_THREAD)
            self._native.chains_call(matchers, chains, bitmask, first_rows, stop_ids, helpers)()
            return
        if self._one_thread is None:
            self._one_thread = xgr.BatchGrammarMatcher(max_threads=1)
        chain_fill_call(self._one_thread, matchers, chains, bitmask, first_rows, stop_ids)()

    # -- without a budget: on the engine thread ---------------------------------------------------
    def _fill_now(self, reqs: Sequence, bitmask: torch.Tensor) -> None:
        self.settle(reqs)  # fills left from a budgeted step (the budget was switched off since)
        live = [i for i, r in enumerate(reqs) if _needs_row(r)]
        if len(live) < len(reqs):
            _allow_all(bitmask, [i for i, r in enumerate(reqs) if not _needs_row(r)])
        if len(live) <= DIRECT_FILL_MAX_ROWS:
            for i in live:
                reqs[i].matcher.fill_bitmask(bitmask, i)
        else:
            self._fill_call([reqs[i].matcher for i in live], bitmask, live)()

    def _fill_call(self, matchers: Sequence, bitmask: torch.Tensor, rows: list[int]) -> Callable[[], None]:
        """The fill of bitmask[rows[i]] from matchers[i] as one GIL-free call: on the native pool's
        persistent threads (a thread per NATIVE_ROWS_PER_THREAD rows), else on xgrammar's batch
        matcher, which starts its threads per call (a thread per ROWS_PER_THREAD rows: waking them
        for a few rows each costs more than it saves); up to `threads` either way."""
        if self._native is not None:
            return partial(self._native.prepare(matchers, bitmask, rows).run,
                           self._native.helpers_for(len(rows), NATIVE_ROWS_PER_THREAD))
        n = max(1, min(self._threads, len(rows) // ROWS_PER_THREAD))
        if n not in self._batch:
            self._batch[n] = xgr.BatchGrammarMatcher(max_threads=n)
        return batch_fill_call(self._batch[n], matchers, bitmask, rows)

    # -- within a budget: on the workers ----------------------------------------------------------
    def _fill_within(self, reqs: Sequence, bitmask: torch.Tensor, deadline: float) -> list[int]:
        self._drop_orphans()
        placed: list[tuple[int, _Job]] = []  # (position, job) for every row a matcher fills
        late: list[int] = []
        fresh: list[_Job] = []
        for i, r in enumerate(reqs):
            if not _needs_row(r):
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
            self._workers.submit(self._slow_last(fresh))
        done = self._wait([job for _, job in placed], deadline)
        sources = [self._ones_row] * len(reqs)
        for (i, job), ok in zip(placed, done):
            if ok:
                sources[i] = job.slot
            else:
                late.append(i)
        torch.index_select(self._staging, 0, torch.tensor(sources), out=bitmask)
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

    def _wait(self, jobs: list[_Job], deadline: float | None) -> list[bool]:
        """Waits until every job is done or the deadline passes; returns which are done (a snapshot:
        a job finishing after it counts from the next step on)."""
        waiter = _Waiter()
        with self._lock:
            for job in jobs:
                if not job.done:
                    job.waiter = waiter
                    waiter.remaining += 1
        if waiter.remaining:
            waiter.event.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        with self._lock:
            for job in jobs:
                job.waiter = None
            return [job.done for job in jobs]

    def _release(self, job: _Job) -> None:
        """The job's row has been used (or dropped): its staging row goes back, the request learns
        how long its fill took."""
        job.req.mask_job = None
        job.req.mask_fill_seconds = job.seconds
        self._outstanding.discard(job)
        self._free_slots.append(job.slot)

    def _drop_orphans(self) -> None:
        """Gives back the staging rows of late fills whose request finished in the meantime."""
        for job in [j for j in self._outstanding if j.req.finished and j.done]:
            self._release(job)


def _needs_row(req) -> bool:
    return req.matcher is not None and not req.finished and not req.discard_inflight


def _allow_all(bitmask: torch.Tensor, rows: list[int]) -> None:
    if len(rows) == 1:
        bitmask[rows[0]].fill_(-1)
    else:
        bitmask.index_fill_(0, torch.tensor(rows), -1)
