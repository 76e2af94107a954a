"""The fill pool's threads: chunks of a fill run in parallel, errors reach the launching thread, and
`launch` returns only once every worker has taken its call."""
from __future__ import annotations

import threading
import time

import pytest

from constrained_spec.engine.fill_pool import FillPool, split


def test_split_covers_the_range_in_near_equal_parts():
    for n in range(0, 40):
        for parts in range(1, 6):
            ranges = split(n, parts)
            assert len(ranges) == parts
            assert [i for r in ranges for i in r] == list(range(n))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_calls_run_on_the_workers_and_join_waits_for_them():
    pool = FillPool(3)
    try:
        for _ in range(50):  # the threads are reused launch after launch
            seen = []
            lock = threading.Lock()

            def call(i):
                def run():
                    time.sleep(0.001)
                    with lock:
                        seen.append((i, threading.current_thread().name))
                return run
            pool.launch([call(i) for i in range(3)])
            pool.join()
            assert sorted(i for i, _ in seen) == [0, 1, 2]
            assert all(name.startswith("grammar-fill-") for _, name in seen)
    finally:
        pool.close()


def test_launch_returns_once_every_worker_has_its_call():
    pool = FillPool(2)
    release = threading.Event()
    running = []
    try:
        def call():
            running.append(1)  # the worker took the call: it ran up to here
            release.wait(5)
        pool.launch([call, call])
        deadline = time.time() + 5
        while len(running) < 2 and time.time() < deadline:
            time.sleep(0.001)
        assert len(running) == 2
        release.set()
        pool.join()
    finally:
        release.set()
        pool.close()


def test_errors_reach_join_and_the_pool_goes_on():
    pool = FillPool(2)
    try:
        def boom():
            raise ValueError("row 7")
        ran = []
        pool.launch([boom, lambda: ran.append(1)])
        with pytest.raises(ValueError, match="row 7"):
            pool.join()
        assert ran == [1]  # the other chunk still ran
        pool.launch([lambda: ran.append(2)])
        pool.join()
        assert ran == [1, 2]
    finally:
        pool.close()


def test_misuse_is_refused():
    pool = FillPool(1)
    try:
        with pytest.raises(ValueError):
            pool.launch([print, print])
        pool.launch([lambda: None])
        with pytest.raises(RuntimeError):
            pool.launch([lambda: None])
        pool.join()
    finally:
        pool.close()
