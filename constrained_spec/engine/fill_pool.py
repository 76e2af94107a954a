"""Persistent threads for a speculative step's grammar masks: the batch's draft chains split into
chunks (`MaskFiller.fill_chains`), each filled by one thread through one-thread xgrammar calls.

Why not xgrammar's own threads (`BatchGrammarMatcher(max_threads=n)`): a chain's rows are filled
depth by depth, two calls per depth, and xgrammar's call pays for its threads on every call
(measured on the 2-core dev machine: 8 rows 21 us on one thread, 114 us on two).

Where these threads lose: beside Python work. Tried for the decode step's fill, which runs while
the step thread runs the step's Python (`engine.py`): a worker whose call returns needs the GIL
back to report, and queues behind that thread; on the H100 host the JSON step at batch 128 took
5.08 ms against 3.10 with xgrammar's threads (profile_decode_host.py, results/host_pool.json). The
decode fill therefore keeps xgrammar's threads; while a speculative step's chains are filled,
nothing else runs Python (the engine thread waits in `join`).

A worker must hold the GIL for the few microseconds it takes to enter a call. `launch` returns
only once every worker has taken its call. The workers are `StepThread`s (one call at a time,
errors raised by `wait`); the pool adds that hand-over and the error of the first chunk.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from .step_thread import StepThread


class FillPool:
    """`workers` threads; `launch(calls)` starts len(calls) <= workers of them, `join` waits for them
    and raises the first error. One launch at a time, from one thread."""

    def __init__(self, workers: int, name: str = "grammar-fill"):
        self.workers = workers
        self._threads = [StepThread(f"{name}-{i}") for i in range(workers)]
        self._taken = [threading.Lock() for _ in range(workers)]
        for lock in self._taken:
            lock.acquire()
        self._launched = 0

    def launch(self, calls: Sequence[Callable[[], None]]) -> None:
        if self._launched:
            raise RuntimeError("FillPool.launch before the last launch was joined")
        if len(calls) > self.workers:
            raise ValueError(f"{len(calls)} calls for {self.workers} workers")
        for thread, taken, call in zip(self._threads, self._taken, calls):
            thread.submit(_taking, taken, call)
        self._launched = len(calls)
        for taken in self._taken[:len(calls)]:
            taken.acquire()

    def join(self) -> None:
        n, self._launched = self._launched, 0
        first: BaseException | None = None
        for thread in self._threads[:n]:
            try:
                thread.wait()
            except BaseException as e:  # noqa: BLE001 - the first is raised once all are done
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        self._launched = 0
        for thread in self._threads:
            thread.close()


def _taking(taken: threading.Lock, call: Callable[[], None]) -> None:
    taken.release()  # the worker holds the GIL and is about to enter the call
    call()


def split(n: int, parts: int) -> list[range]:
    """`parts` contiguous ranges of near-equal length covering range(n)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        out.append(range(start, stop))
        start = stop
    return out
