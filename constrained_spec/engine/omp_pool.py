"""Keeping torch's CPU thread pools from slowing each other down.

torch's CPU ops parallelize with OpenMP (libgomp). libgomp gives every thread that runs a parallel
op its own pool of worker threads, and keeps that pool until the thread exits. While the process
holds more pool threads than it has CPUs, libgomp stops spinning between parallel regions: each
region then wakes its workers through the kernel and waits for them the same way, tens of µs a
region. A decode step runs hundreds of regions (every GEMM, KV gather and attention call), so on the
2-core CPU a SmolLM2 batch-8 step went from 36 to 55 ms (bf16) once a second pool existed — the
engine thread's beside the pool the model loading had left on the thread that built the engine.

So on CPU the engine does its start-up tensor work on a short-lived thread (`on_fresh_thread`): the
pool made there goes away with the thread, and the engine thread's pool is the process's only one,
unless the application itself runs torch ops on another thread (then both slow down; see
benchmarks/bench_cpu.py, which runs transformers on a short-lived thread for that reason).
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T], name: str = "constrained-spec-setup") -> T:
    """Runs fn() on a new thread, waits for it, and returns its result or raises its exception.
    Whatever OpenMP pool fn's torch ops create is freed when the thread exits."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
