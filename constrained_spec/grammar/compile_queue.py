"""The compile queue: grammars compile on worker threads, once per key, within a time limit.

Compiles are queued (FIFO) to `workers` threads. The timeout counts a grammar's own compile time,
from the moment a worker starts it: a refusal for the grammar (400). Time in the queue is the
server's load: up to QUEUE_WAIT_TIMEOUTS timeouts it is latency, past that the request gets
`GrammarBusy` (the server answers 503 with Retry-After) and the job leaves the queue once none of
its requests waits. Neither backend can cancel a compile, so one that overruns keeps its thread
(and its result is cached when it ends) while a spare thread takes its place. A full queue is
`GrammarBusy` too, never a grammar error. Results (compiled grammars and refusals) are kept in an
LRU keyed by the caller's key, which names the backend, bounded by count and by memory: the
compiled grammars' (`CompiledGrammar.memory_bytes`; one 20,000-string enum is ~9 MB under
xgrammar, and a count alone let 150 of them grow the engine by 1.4 GB) and the schema texts each
entry holds in its key and spec (`text_bytes`).

Two lanes: fast jobs (llguidance's compiles, ~1 ms) go before slow ones (xgrammar's, 10 ms to
minutes), and slow jobs hold at most `workers` threads, of `workers + 1`: a new schema's compile
never waits behind slow ones (it waited 20 s to 7 minutes behind two to four xgrammar compiles of
wide objects on 2 cores). A fast job that turns out slow (auto's fallback to xgrammar) raises
`SlowLane` and queues again in the slow lane, its requests still waiting on it. However many slow
compiles overrun, one thread stays free of them for the fast lane.
"""
from __future__ import annotations

import atexit
import bisect
import heapq
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..cpus import name_os_thread
from .errors import GrammarBusy, GrammarError, GrammarTooComplex
from .bounded_lru import BoundedLRU
from .spec import GrammarSpec

log = logging.getLogger("constrained_spec.grammar")

MAX_PENDING_SAVES = 64  # compiled grammars waiting for the saver thread (`_save_later`)
# A request waits for a compile thread at most this many compile timeouts. Slow compiles end or are
# replaced within one timeout each, so a queue that moves serves the jobs queued behind them in
# time; one that has not reached a job by twice the timeout is stuck behind overruns (xgrammar
# cannot cancel a compile of minutes) or overloaded, and its clients waited without an answer.
# Not one timeout: a request queued right behind a compile that ends just within its timeout would
# be refused for no fault of the queue's.
QUEUE_WAIT_TIMEOUTS = 2


@dataclass
class CompiledGrammar:
    spec: GrammarSpec
    backend: str  # "xgrammar" or "llguidance"
    grammar: Any  # xgrammar.CompiledGrammar, or the llguidance template LLMatcher
    compile_seconds: float
    prepared: Optional[str] = None  # what the backend compiled: xgrammar's rewritten JSON schema, llguidance's grammar text
    memory_bytes: int = 0  # xgrammar's memory_size_bytes; llguidance's estimated (`llguidance_backend.memory_estimate`)
    from_disk: bool = False  # loaded from the disk cache (compile_seconds is then the load's)
    pruned: bool = False  # xgrammar's grammar of the spec without its dead branches (`dead_branches.productivity`)


class Latency:
    """Seconds observed: Prometheus buckets for /metrics, recent samples for exact percentiles."""

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

    def __init__(self, recent: int = 4096):
        self.counts = [0] * (len(self.BUCKETS) + 1)  # the last is +Inf
        self.sum = 0.0
        self.recent: deque = deque(maxlen=recent)

    def observe(self, s: float) -> None:
        self.counts[bisect.bisect_left(self.BUCKETS, s)] += 1
        self.sum += s
        self.recent.append(s)

    def snapshot(self) -> dict:
        r = sorted(self.recent)
        q = (lambda p: r[min(len(r) - 1, int(p * len(r)))] if r else 0.0)
        return {"buckets": list(zip(self.BUCKETS + (math.inf,), itertools.accumulate(self.counts))),
                "sum": self.sum, "count": sum(self.counts), "p50": q(0.5), "p99": q(0.99),
                "max": r[-1] if r else 0.0}


class SlowLane(Exception):
    """Raised by a fast job's build: the compile continues as `build` in the slow lane."""

    def __init__(self, build: Callable[[], CompiledGrammar]):
        super().__init__("continued in the slow lane")
        self.build = build


class _Job:
    """One compile, shared by every request whose grammar has `key`."""
    __slots__ = ("key", "spec", "build", "persist", "slow", "done", "queued", "started", "overran", "waiters",
                 "__weakref__")

    def __init__(self, key, spec: GrammarSpec, build: Callable[[], CompiledGrammar],
                 persist: Optional[Callable[[CompiledGrammar], None]], slow: bool):
        self.key, self.spec, self.build, self.persist, self.slow = key, spec, build, persist, slow
        self.done: Future = Future()
        self.queued = time.monotonic()
        self.started: Optional[float] = None
        self.overran = False
        self.waiters: list = []  # (Future, timeout_s or None) of the requests waiting on it


_OPEN_QUEUES: "weakref.WeakSet[CompileQueue]" = weakref.WeakSet()


@atexit.register
def _close_open_queues() -> None:
    """A program that exits without closing its engine still waits for the compiles in flight
    (see CompileQueue.close): atexit runs before the interpreter stops its daemon threads."""
    for queue in list(_OPEN_QUEUES):
        queue.close()


class CompileQueue:
    def __init__(self, workers: int, timeout_s: float = 30.0, cache_size: int = 512, max_queue: int = 4096,
                 cache_bytes: int = 512 << 20):
        self.workers = max(1, int(workers))
        self.timeout_s = float(timeout_s)
        # key -> CompiledGrammar | GrammarError
        self._cache = BoundedLRU(cache_size, cache_bytes, _bytes)
        self._jobs: dict = {}  # key -> _Job, queued or compiling
        self._queue: deque = deque()  # fast jobs
        self._slow: deque = deque()  # slow jobs
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for a job
        self._tick = threading.Condition(self._lock)  # the watchdog waits here for a deadline
        self._ended = threading.Condition(self._lock)  # close waits here for the workers to end
        self._running: set = set()  # jobs a worker is compiling
        # (deadline, n, job, job.queued, Future, timeout_s) of the requests waiting for their job to
        # start; the job and Future by weak reference: an entry outlives its job's start by up to its
        # deadline, and held the job's compiled grammar and schema texts that long
        self._queue_deadlines: list = []
        self._arrivals = itertools.count()
        self._closed = False
        self._threads = 0
        self._save_running = False  # the saver thread is saving one (not in `_saves` any more)
        self._saves: deque = deque()  # (persist, compiled grammar) for the saver thread
        self._save_ready = threading.Condition(self._lock)
        self._saver_thread: Optional[threading.Thread] = None  # started on the first save
        self._stats = {"compile_count": 0, "cache_hits": 0, "cache_misses": 0,
                       "compile_seconds_total": 0.0, "compile_seconds_max": 0.0,
                       "compile_errors": 0, "compile_timeouts": 0, "spare_threads_started": 0,
                       "queue_timeouts": 0}
        self._compile_latency = Latency()
        self._queue_wait = Latency()
        for _ in range(self.workers + 1):  # one more than slow jobs may hold
            self._spawn()
        threading.Thread(target=self._watchdog, name="grammar-compile-watchdog", daemon=True).start()
        _OPEN_QUEUES.add(self)

    @property
    def stats(self) -> dict:
        with self._lock:
            d = dict(self._stats)
            d["cache_size"] = len(self._cache)
            d["cache_bytes"] = self._cache.bytes
            d["inflight"] = len(self._jobs)
            d["queue_depth"] = len(self._queue) + len(self._slow)
            d["compiling"] = len(self._running)
            d["disk_saving"] = len(self._saves) + self._save_running
            d["compile_workers"] = self.workers
            d["compile_latency"] = self._compile_latency.snapshot()
            d["queue_wait"] = self._queue_wait.snapshot()
        return d

    def observe_compile(self, seconds: float) -> None:
        """A compile (not a load from disk) took this long."""
        with self._lock:
            self._stats["compile_count"] += 1
            self._stats["compile_seconds_total"] += seconds
            self._stats["compile_seconds_max"] = max(self._stats["compile_seconds_max"], seconds)
            self._compile_latency.observe(seconds)

    def count_error(self) -> None:
        with self._lock:
            self._stats["compile_errors"] += 1

    def cached(self, key, spec: GrammarSpec) -> Optional[CompiledGrammar]:
        """The compiled grammar for `key` (naming `spec`) if it is in the cache (a hit), else None."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is None or isinstance(hit, GrammarError):
                return None
            self._stats["cache_hits"] += 1
        return _for(hit, spec)

    def submit(self, key, spec: GrammarSpec, build: Callable[[], CompiledGrammar],
               persist: Optional[Callable[[CompiledGrammar], None]] = None,
               timeout_s: Optional[float] = None, slow: bool = False) -> Future:
        """Future[CompiledGrammar] for `key` (built by `build()` on a worker unless cached or
        compiling already, in the slow lane if `slow`); fails with the GrammarError `build` raises,
        or when the compile runs longer than timeout_s; with GrammarBusy when it waited in the queue
        past QUEUE_WAIT_TIMEOUTS times the queue's timeout (only where timeout_s is not 0: a
        background compile waits as long as it takes). `persist(compiled)` runs on the saver thread
        after the result is out. Raises GrammarBusy when the queue is full."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        out: Future = Future()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._stats["cache_hits"] += 1
            elif self._closed:  # no worker would take it (QA 1130: compile_grammar after shutdown hung)
                hit = GrammarError("the grammar backend was closed")
            else:
                job = self._jobs.get(key)
                if job is None:
                    waiting = len(self._queue) + len(self._slow)
                    if waiting >= self._max_queue:
                        raise GrammarBusy(f"{waiting} grammars are waiting to compile; retry later")
                    self._stats["cache_misses"] += 1
                    job = self._jobs[key] = _Job(key, spec, build, persist, slow)
                    (self._slow if slow else self._queue).append(job)
                    self._work.notify()
                # joined under the same lock as the lookup: the watchdog drops a job none waits for
                job.waiters.append((out, timeout_s))
                if timeout_s is not None:
                    if job.started is None:
                        self._wait_in_queue(job, out, timeout_s, time.monotonic())
                    self._tick.notify()
        if hit is not None:
            if isinstance(hit, GrammarError):
                out.set_exception(hit)
            else:
                out.set_result(_for(hit, spec))
            return out

        def relay(f: Future) -> None:
            exc = f.exception()
            try:
                if exc is not None:
                    out.set_exception(exc)
                else:
                    out.set_result(_for(f.result(), spec))
            except InvalidStateError:  # timed out first
                pass

        job.done.add_done_callback(relay)
        return out

    def _wait_in_queue(self, job: _Job, out: Future, timeout_s: float, since: float) -> None:  # under the lock
        if self.timeout_s > 0:
            heapq.heappush(self._queue_deadlines, (since + QUEUE_WAIT_TIMEOUTS * self.timeout_s, next(self._arrivals),
                                                   weakref.ref(job), job.queued, weakref.ref(out), timeout_s))

    def close(self, wait_s: Optional[float] = None) -> bool:
        """Stops the workers once their compiles end; queued compiles fail. Waits up to `wait_s`
        (the compile timeout by default) for the running compiles, because a worker still inside
        native compile code when the interpreter exits is unwound by CPython 3.11's pthread_exit and
        aborts the process. Returns whether every worker has ended."""
        _OPEN_QUEUES.discard(self)
        with self._lock:
            self._closed = True
            queued, self._queue, self._slow = list(self._queue) + list(self._slow), deque(), deque()
            for job in queued:
                del self._jobs[job.key]
            self._queue_deadlines.clear()
            self._saves.clear()  # saves not begun are dropped; one under way ends first
            self._work.notify_all()
            self._tick.notify_all()
            self._save_ready.notify_all()
        for job in queued:
            job.done.set_exception(GrammarError("the grammar backend was closed"))
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        with self._lock:
            while self._threads > 0 or self._save_running:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("closing with %d grammar compiles still running", len(self._running))
                    return False
                self._ended.wait(left)
        return True

    # -- workers ---------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._worker, name="grammar-compile", daemon=True).start()

    def _next_job(self) -> Optional[_Job]:  # under the lock
        if self._queue:
            return self._queue.popleft()
        # a slow job also leaves one thread free of slow jobs, overruns included: once the spares
        # are all started, overrunning compiles (uncancellable, minutes) held every thread and a
        # new schema's ~1 ms compile waited for them past any client's timeout (QA, 2 cores)
        if (self._slow and self._slow_lane_busy() < self.workers
                and sum(1 for job in self._running if job.slow) < self._threads - 1):
            return self._slow.popleft()
        return None

    def _slow_lane_busy(self) -> int:  # under the lock
        """Slow jobs holding a thread of the lane's (an overrun's thread was replaced by a spare)."""
        return sum(1 for job in self._running if job.slow and not job.overran)

    def _worker(self) -> None:
        name_os_thread("cs-compile")
        while True:
            with self._work:
                job = None
                while not self._closed and (job := self._next_job()) is None:
                    self._work.wait()
                if self._closed:
                    self._threads -= 1
                    self._ended.notify_all()
                    return
                job.started = time.monotonic()
                self._queue_wait.observe(job.started - job.queued)
                self._running.add(job)
                self._tick.notify()
            try:
                value = job.build()
            except SlowLane as turn:
                if self._to_slow_lane(job, turn.build):
                    return
                continue
            except GrammarError as e:
                value = e
            except Exception as e:  # noqa: BLE001 (a bug here must not kill the worker)
                log.exception("grammar compile failed")
                value = GrammarError(f"{job.spec.kind} failed to compile: {e}")
            with self._lock:
                self._store(job.key, value)
                del self._jobs[job.key]
                self._running.discard(job)
                if job.slow and not job.overran:  # the lane may start another slow job
                    self._work.notify()
                # the thread of an overrun was replaced by a spare: one of them goes
                retire = job.overran and self._threads > self.workers + 1
                if retire:
                    self._threads -= 1
                    self._ended.notify_all()
            if isinstance(value, GrammarError):
                job.done.set_exception(value)
            else:
                job.done.set_result(value)
                if job.persist is not None:
                    self._save_later(job.persist, value)
            if retire:
                return

    # -- saving to disk ----------------------------------------------------------------------------
    def _save_later(self, persist: Callable[[CompiledGrammar], None], value: CompiledGrammar) -> None:
        """Hands a compiled grammar to the saver thread, started on first use; dropped when
        MAX_PENDING_SAVES wait already (a save only spares a later compile, and each waiting one
        holds its grammar in memory)."""
        with self._lock:
            if self._closed or len(self._saves) >= MAX_PENDING_SAVES:
                return
            self._saves.append((persist, value))
            if self._saver_thread is None:
                self._saver_thread = threading.Thread(target=self._saver, name="grammar-save", daemon=True)
                self._saver_thread.start()
            self._save_ready.notify()

    def _saver(self) -> None:
        """Saves compiled grammars one at a time, at the lowest CPU priority: serializing and
        compressing one takes seconds of CPU that the engine's forward needs more (2 cores, 400
        distinct schemas: the run took 157 s with saves on the compile workers, 101 s without the
        disk cache), and a compile worker is free for the next compile meanwhile."""
        name_os_thread("cs-grammar-save")
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        while True:
            with self._lock:
                while not self._saves and not self._closed:
                    self._save_ready.wait()
                if not self._saves:
                    return
                persist, value = self._saves.popleft()
                self._save_running = True
            try:
                persist(value)
            except Exception:  # noqa: BLE001 (a save can only fail to save)
                log.exception("grammar cache: saving a compiled grammar failed")
            finally:
                with self._lock:
                    self._save_running = False
                    self._ended.notify_all()

    def _to_slow_lane(self, job: _Job, build: Callable[[], CompiledGrammar]) -> bool:
        """The job queued again, as `build`, in the slow lane; its timeout starts again when a
        worker takes it. Returns whether this thread retires (a spare replaced it meanwhile)."""
        with self._lock:
            self._running.discard(job)
            retire = job.overran and self._threads > self.workers + 1
            if retire:
                self._threads -= 1
                self._ended.notify_all()
            job.build, job.slow, job.started, job.queued, job.overran = build, True, None, time.monotonic(), False
            self._slow.append(job)
            for out, timeout_s in job.waiters:  # their wait starts again with the job's
                if timeout_s is not None and not out.done():
                    self._wait_in_queue(job, out, timeout_s, job.queued)
            self._work.notify()
            self._tick.notify()
        return retire

    def _store(self, key, value) -> None:  # under the lock
        """Least recently used out first, past either bound. A grammar larger than the whole byte
        bound is not kept, nor does it push the others out: the requests waiting for it have it,
        later ones compile it again."""
        self._cache.put(key, value)

    def _overran(self, job: _Job) -> None:
        with self._lock:
            if job.overran or job.done.done():
                return
            job.overran = True  # its thread is replaced: the lane may start another slow job
            self._stats["compile_timeouts"] += 1
            if self._threads < 2 * self.workers + 1 and not self._closed:
                self._stats["spare_threads_started"] += 1
                self._spawn()
        log.warning("grammar compile still running after its %gs timeout (%s)", self.timeout_s, job.spec.kind)

    def _watchdog(self) -> None:
        """Fails the requests whose grammar has compiled longer than their timeout, or waited in the
        queue too long."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now, expired, wake = time.monotonic(), [], None
                    for job in self._running:
                        job.waiters = [w for w in job.waiters if not w[0].done()]
                        for out, timeout_s in job.waiters:
                            if timeout_s is None:
                                continue
                            deadline = job.started + timeout_s
                            if deadline <= now:
                                expired.append((job, out, timeout_s))
                            else:
                                wake = deadline if wake is None else min(wake, deadline)
                    gave_up, dropped = self._waited_too_long(now)
                    if self._queue_deadlines:
                        first = self._queue_deadlines[0][0]
                        wake = first if wake is None else min(wake, first)
                    if expired or gave_up or dropped:
                        break
                    self._tick.wait(None if wake is None else wake - now)
            for job, out, timeout_s in expired:
                self._overran(job)
                try:
                    out.set_exception(GrammarTooComplex(f"compile exceeded {timeout_s:g}s: this grammar is too "
                                                        "large or complex to compile in time"))
                except InvalidStateError:  # the compile ended meanwhile
                    pass
            busy = (f"the grammar waited {QUEUE_WAIT_TIMEOUTS * self.timeout_s:g}s for a compile thread "
                    f"({QUEUE_WAIT_TIMEOUTS} x the {self.timeout_s:g}s compile timeout): more grammars to compile "
                    "than the threads got through; retry later")
            if gave_up:
                log.warning("%s (%d requests; %d grammars left the queue)", busy, len(gave_up), len(dropped))
            for out in gave_up:
                try:
                    out.set_exception(GrammarBusy(busy))
                except InvalidStateError:  # answered meanwhile
                    pass
            for job in dropped:
                job.done.set_exception(GrammarBusy(busy))

    def _waited_too_long(self, now: float):  # under the lock
        """The requests whose job has not started by their queue deadline, taken off their jobs, and
        the queued jobs none waits for any more, taken out of the queue (compiling one for nobody
        would hold a thread for as long as the compiles it waited behind)."""
        gave_up, dropped = [], []
        while self._queue_deadlines and self._queue_deadlines[0][0] <= now:
            _, _, job, queued, out, timeout_s = heapq.heappop(self._queue_deadlines)
            job, out = job(), out()
            if job is None or job.started is not None or job.queued != queued:
                continue  # compiled, compiling (its own timeout holds), or queued again since
            if out is not None and not out.done():  # else cancelled, or dropped, by its caller
                job.waiters.remove((out, timeout_s))
                gave_up.append(out)
                self._stats["queue_timeouts"] += 1
            if self._jobs.get(job.key) is job and all(w.done() for w, _ in job.waiters):
                (self._slow if job.slow else self._queue).remove(job)
                del self._jobs[job.key]
                dropped.append(job)
        return gave_up, dropped


def _bytes(key, value) -> int:
    """What a cache entry counts against the byte bound: the compiled grammar's memory and the texts
    the entry holds (a refusal's message aside): the key's schema text, and the spec's raw text and
    the prepared text a compiled grammar keeps. Counted by memory alone, 512 0.5 MB schemas (refused,
    or compiled to a small grammar: a long description) held 256-512 MB that counted nothing."""
    if isinstance(value, CompiledGrammar):
        return value.memory_bytes + text_bytes(key, value.spec.value, value.prepared)
    return text_bytes(key)


def text_bytes(*parts) -> int:
    """The memory of the strings among `parts` and in the tuples among them, each string once (a
    key and its value often share one)."""
    held, todo = {}, list(parts)
    while todo:
        part = todo.pop()
        if isinstance(part, str):
            held[id(part)] = sys.getsizeof(part)
        elif isinstance(part, tuple):
            todo.extend(part)
    return sum(held.values())


def _for(compiled: CompiledGrammar, spec: GrammarSpec) -> CompiledGrammar:
    """The shared compile, naming the requester's spec."""
    if compiled.spec == spec:
        return compiled
    import dataclasses
    return dataclasses.replace(compiled, spec=spec)
