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
only once every worker has taken its call.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence


class FillPool:
    """`workers` threads; `launch(calls)` starts len(calls) <= workers of them, `join` waits for them
    and raises the first error. One launch at a time, from one thread."""

    def __init__(self, workers: int, name: str = "grammar-fill"):
        self.workers = workers
        self._calls: list[Callable[[], None] | None] = [None] * workers
        self._errors: list[BaseException | None] = [None] * workers
        self._go = [_held_lock() for _ in range(workers)]
        self._taken = [_held_lock() for _ in range(workers)]
        self._done = [_held_lock() for _ in range(workers)]
        self._launched = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def launch(self, calls: Sequence[Callable[[], None]]) -> None:
        if self._launched:
            raise RuntimeError("FillPool.launch before the last launch was joined")
        if len(calls) > self.workers:
            raise ValueError(f"{len(calls)} calls for {self.workers} workers")
        for i, call in enumerate(calls):
            self._calls[i] = call
            self._go[i].release()
        self._launched = len(calls)
        for i in range(len(calls)):
            self._taken[i].acquire()

    def join(self) -> None:
        n, self._launched = self._launched, 0
        for i in range(n):
            self._done[i].acquire()
        errors = [e for e in self._errors[:n] if e is not None]
        self._errors[:n] = [None] * n
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.join()
        except Exception:  # noqa: BLE001 - closing: nobody is left to hand it to
            pass
        for i in range(self.workers):
            self._calls[i] = None
            self._go[i].release()
        for t in self._threads:
            t.join(timeout=5)

    def _run(self, i: int) -> None:
        go, taken, done = self._go[i], self._taken[i], self._done[i]
        while True:
            go.acquire()
            call, self._calls[i] = self._calls[i], None
            if call is None:
                return
            taken.release()
            try:
                call()
            except BaseException as e:  # noqa: BLE001 - raised by `join`, on the launching thread
                self._errors[i] = e
            done.release()


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


def split(n: int, parts: int) -> list[range]:
    """`parts` contiguous ranges of near-equal length covering range(n)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        out.append(range(start, stop))
        start = stop
    return out
