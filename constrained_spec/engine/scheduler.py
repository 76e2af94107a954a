"""Continuous batching: who runs in the next step, and with how many tokens.

Prefill (EXTEND) steps take priority over decode steps, so a new request's first token comes
quickly; prompts longer than the per-step token budget are prefilled in chunks, with a decode step
between two chunks, so that a long prompt holds the running requests' next tokens for one chunk's
step, not for its whole prefill (thousands of tokens: minutes on a CPU). When the KV pool
cannot hold one more token per running request, the newest request is retracted (its slots freed,
its tokens kept) and re-prefilled later: a full pool makes work wait, it never crashes.

With the prefix cache (`prefix_cache.py`) an admitted request starts from its longest cached
prefix and costs the step's budget only for the rest; slots the cache holds but nobody uses count
as free (the pool evicts them on demand). Among the first ADMISSION_WINDOW waiting requests the one
with the longest cached prefix goes first (it needs the fewest new tokens, so more requests start
per step: SGLang's longest-prefix-first), but a request passed over MAX_SKIPS times goes next.
A request that shares a long uncached prefix with one admitted in the same step waits for the next
step, where that prefix is cached (IN_STEP_SHARE).
"""
from __future__ import annotations

import time
from collections import deque
from itertools import islice

import numpy as np

from ..attention.base import ForwardMode
from .batch import ScheduledBatch
from .config import EngineConfig
from .prefix_cache import min_match
from .request import Request, Status

ADMISSION_WINDOW = 16  # waiting requests compared by cached prefix length
MAX_SKIPS = 8  # a request passed over this often is admitted next (no starvation)
# a request sharing this many uncached tokens with one admitted in the same step waits a step, to
# find them cached instead of computing them twice (n > 1 siblings, a burst with one system prompt)
IN_STEP_SHARE = 128


class Scheduler:
    def __init__(self, runner, config: EngineConfig):
        self.runner = runner
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0
        self._chunk_in_progress = False  # the last step left a prompt part-prefilled: decode next

    @property
    def pool(self):
        return self.runner.pool

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Takes a finished or aborted request out of the queues and returns its KV."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.runner.release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, can_retract: bool) -> ScheduledBatch | None:
        """The next batch, or None when nothing can run now (or a retraction must wait for the
        step in flight to be processed: `can_retract` False)."""
        if self._chunk_in_progress:
            batch = self._schedule_decode(can_retract) or self._schedule_extend()
        else:
            batch = self._schedule_extend() or self._schedule_decode(can_retract)
        if batch is None and can_retract and len(self.running) > 1 and self.pool.num_free == 0:
            # Only partial prefills hold the pool: free the newest so the others can finish.
            self._retract(max(self.running, key=lambda r: r.arrival))
            batch = self._schedule_extend()
        self._chunk_in_progress = batch is not None and batch.mode is ForwardMode.EXTEND and not all(batch.samples)
        cache = self.runner.prefix_cache
        if cache is not None and (batch is None or batch.mode is not ForwardMode.EXTEND):
            # Rows `cache_prompts` repointed, on the device before anything launches; an extend
            # step carries them with its prefixes instead (`ModelRunner.forward`: each upload of
            # their own is a few GIL-releasing torch calls, which a loaded server's engine thread
            # waits to get back from).
            cache.write_device()
        return batch

    def _schedule_extend(self) -> ScheduledBatch | None:
        cache = self.runner.prefix_cache
        if cache is not None:
            cache.cache_prompts()
        budget = self.config.max_prefill_tokens
        free = self.pool.num_free - sum(1 for r in self.running if not r.needs_extend)  # keep the next decode's slots
        reqs, counts, samples = [], [], []

        def take(req: Request) -> bool:
            nonlocal budget, free
            remaining = req.total_len - req.num_cached
            n = min(remaining, budget, free)
            if n <= 0:
                return False
            free -= n
            reqs.append(req)
            counts.append(n)
            last = n == remaining
            samples.append(last)
            if last:
                req.needs_extend = False
                if cache is not None:
                    cache.prompt_scheduled(req)
            budget -= n
            return True

        fresh = _PromptsInStep()  # prompts being computed (a long part not cached yet)
        # longest-prefix-first only where the order decides who waits: matching every waiting
        # prompt for nothing was ~2% of a loaded engine thread's samples on short prompts; and not
        # while the cache misses (`PrefixCache.filing`): every length would be 0, first come first
        # served, after ~4 us of `_all_fit` a step and a lookup per waiting prompt
        by_prefix = cache is not None and self.waiting and cache.filing and not self._all_fit(budget, free)
        cached_lengths: dict | None = {} if by_prefix else None
        deferred: set = set()  # waiting for a prompt this step computes
        for req in self.running:  # chunked prefills and jump-forward tokens in progress
            if not req.needs_extend:
                continue
            if cache is not None:
                fresh.add(req)
            if budget > 0:
                take(req)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            if self.runner.table.num_free_rows == 0:
                break
            req = self._next_waiting(cached_lengths, deferred)
            if req is None:
                break
            if cache is not None:
                free -= cache.admit(req)
                if fresh.shares(req):
                    free += cache.unadmit(req)
                    deferred.add(req)
                    continue
                if not take(req):
                    free += cache.unadmit(req)
                    break
                cache.admitted(req)
                fresh.add(req)
            elif not take(req):
                break
            self._admit(req)
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, counts, samples)

    def _all_fit(self, budget: int, free: int) -> bool:
        """Whether every waiting request can start this step even with nothing cached (then the
        admission order changes nothing)."""
        room = min(self.runner.table.num_free_rows, self.config.max_running_requests - len(self.running))
        if len(self.waiting) > room:
            return False
        need = sum(r.total_len - r.num_cached for r in self.waiting)
        return need <= budget and need <= free

    def _next_waiting(self, cached_lengths: dict | None, deferred: set) -> Request | None:
        """The waiting request to admit next, None if all of them wait for this step's prompts
        (`deferred`). First come, first served, or with `cached_lengths` (the prefix cache's
        lengths, memoized for one scheduling pass: the tree does not change during one) the one
        with the longest cached prompt prefix among the first ADMISSION_WINDOW (ties: the
        earliest), unless a request before it was passed over MAX_SKIPS times already."""
        if cached_lengths is None:
            return next((req for req in self.waiting if req not in deferred), None)
        tree = self.runner.prefix_cache.tree
        best, best_len = None, -1
        for req in islice(self.waiting, ADMISSION_WINDOW):
            if req in deferred:
                continue
            if req.skips >= MAX_SKIPS:
                return req
            n = cached_lengths.get(req)
            if n is None:
                ids = req.ids_array(len(req.prompt_ids))
                n = cached_lengths[req] = tree.match_length(ids, min_match(len(ids)))
            if n > best_len:
                best, best_len = req, n
        return best

    def _admit(self, req: Request) -> None:
        if req is self.waiting[0]:
            self.waiting.popleft()
        else:
            for other in self.waiting:
                if other is req:
                    break
                other.skips += 1
            self.waiting.remove(req)
        req.status = Status.RUNNING
        if req.admitted_time is None:
            req.admitted_time = time.monotonic()
        self.running.append(req)

    def _schedule_decode(self, can_retract: bool) -> ScheduledBatch | None:
        ready = [r for r in self.running if not r.needs_extend]
        if not ready:
            return None
        while self.pool.num_free < len(ready):
            if not can_retract:
                return None
            victim = max(self.running, key=lambda r: r.arrival)
            self._retract(victim)
            if victim in ready:
                ready.remove(victim)
            if not ready:
                return None
        return ScheduledBatch(ForwardMode.DECODE, ready, [1] * len(ready), [True] * len(ready))

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.runner.release(req)
        req.needs_extend = True
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_retractions += 1


class _PromptsInStep:
    """The prompts a step computes an uncached part of IN_STEP_SHARE tokens or more, indexed by
    (cached length, the IN_STEP_SHARE tokens past it), so that whether a request shares that many
    uncached tokens with one of them is one lookup: two prompts that share their first c + IN_STEP_SHARE
    tokens, matched against the same tree, have the same cached length c. (A running chunked prefill
    was matched at an earlier step; if the tree has grown under it since, a request sharing its
    prompt is not found and computes the shared part too, which costs time, not correctness.)
    Comparing each admitted request with every other instead cost ~2% of a loaded engine thread."""

    def __init__(self):
        self._by_key: dict[tuple[int, bytes], list[np.ndarray]] = {}
        # (request, cached length) indexed at the next `shares`: most steps admit one request and
        # never ask, so building its key (a slice of its prompt copied to bytes) would be for nothing
        self._unindexed: list[tuple[Request, int]] = []

    @staticmethod
    def _key(req: Request, c: int) -> tuple[tuple[int, bytes] | None, np.ndarray]:
        ids = req.ids_array(len(req.prompt_ids))
        if len(ids) < c + IN_STEP_SHARE:
            return None, ids
        return (c, ids[c:c + IN_STEP_SHARE].tobytes()), ids

    def add(self, req: Request) -> None:
        self._unindexed.append((req, req.cache_len))

    def shares(self, req: Request) -> bool:
        for other, c in self._unindexed:
            key, ids = self._key(other, c)
            if key is not None:
                self._by_key.setdefault(key, []).append(ids)
        self._unindexed.clear()
        if not self._by_key:
            return False
        key, ids = self._key(req, req.cache_len)
        if key is None:
            return False
        c = key[0]
        return any(np.array_equal(prompt[:c], ids[:c]) for prompt in self._by_key.get(key, ()))
