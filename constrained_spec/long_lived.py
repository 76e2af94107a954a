"""A process's long-lived objects out of the cyclic garbage collector's way.

What a process builds before it serves (an engine's model, tokenizer, CUDA graphs, torch's and the
grammar libraries' own objects; a front-end's app, routes and tokenizer) lives as long as the
process: hundreds of thousands of objects a full collection would walk each time, stopping every
thread of the process meanwhile. Frozen (`gc.freeze`), a full collection walks only what was made
since. On a CPU engine the first full collection under load took ~150 ms before and ~11 ms after.
"""
from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze() -> None:
    """Collects what is garbage now, then freezes everything left. Unfrozen at exit, so that the
    interpreter's shutdown still frees it (else nanobind-bound libraries report it leaked)."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True


def unfreeze() -> None:
    """Frozen objects become collectable again (an engine shut down: its cycles, its model among
    them, would otherwise stay for the process's life)."""
    gc.unfreeze()
