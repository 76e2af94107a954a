"""Continuous batching: who runs in the next step, and with how many tokens.

Prefill (EXTEND) steps take priority over decode steps, so a new request's first token comes
quickly; prompts longer than the per-step token budget are prefilled in chunks. When the KV pool
cannot hold one more token per running request, the newest request is retracted (its slots freed,
its tokens kept) and re-prefilled later: a full pool makes work wait, it never crashes.
"""
from __future__ import annotations

from collections import deque

from ..attention.base import ForwardMode
from .batch import ScheduledBatch
from .config import EngineConfig
from .request import Request, Status


class Scheduler:
    def __init__(self, runner, config: EngineConfig):
        self.runner = runner
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0

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
        batch = self._schedule_extend() or self._schedule_decode(can_retract)
        if batch is None and can_retract and len(self.running) > 1 and self.pool.num_free == 0:
            # Only partial prefills hold the pool: free the newest so the others can finish.
            self._retract(max(self.running, key=lambda r: r.arrival))
            batch = self._schedule_extend()
        return batch

    def _schedule_extend(self) -> ScheduledBatch | None:
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
            budget -= n
            return True

        for req in self.running:  # chunked prefills and jump-forward tokens in progress
            if req.needs_extend and budget > 0:
                take(req)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self.runner.table.num_free_rows == 0 or not take(req):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, counts, samples)

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
