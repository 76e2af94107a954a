"""Grammar bitmask rows, and token accepts, on persistent native threads (`native/mask_fill_pool.h`).

xgrammar's `BatchGrammarMatcher` starts and joins its threads in every call (~40-75 us each on
the H100 host); at batch 32-128 that made the decode step's fill the last thing to end on the
host, and its batch accept runs on one thread.
`NativeFill` makes the same per-row calls into xgrammar (`GrammarMatcher.fill_next_token_bitmask`,
`accept_token`, `rollback`, through the TVM FFI C ABI that xgrammar's own Python bindings use) from
threads that live as long as the engine: a step's token accepts (`accept`), its bitmask rows
(`prepare`, then `PoolFill.run`, or `start` and `finish` around other work) and a speculative
step's draft chains (`chains_call`). 128 rows of real JSON states on the H100 host: 0.11 ms against 0.52-0.96 for
xgrammar's batch matcher at 1-14 threads (`benchmarks/bench_mask_fill.py`).

`NativeFill.create` returns None where that ABI is not found (another xgrammar or tvm-ffi layout,
or no native extension): callers then use xgrammar's batch matcher.
"""
from __future__ import annotations

import ctypes
import logging
import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .backend import REFUSED_DRAFT

log = logging.getLogger(__name__)

_METHODS = frozenset({"fill_next_token_bitmask", "accept_token", "rollback"})


def _ffi_entry_points() -> tuple[int, int, int]:
    import tvm_ffi.libinfo
    lib = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi())  # already loaded by xgrammar: the same copy
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                 for name in ("TVMFFIFunctionCall", "TVMFFIErrorMoveFromRaised", "TVMFFIObjectDecRef"))


def _check_bitmask(bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")


def _handles(matchers: Sequence) -> np.ndarray:
    """The matchers' FFI object addresses (RequestMatcher.ffi_handle), checked: the pool would
    dereference a null one."""
    handles = np.array([m.ffi_handle for m in matchers], dtype=np.int64)
    if len(handles) and not handles.all():
        raise ValueError("a matcher without an FFI handle (another xgrammar layout)")
    return handles


class NativeFill:
    """`workers` persistent threads. Each call runs on the caller's thread and up to `helpers` of
    them, with the GIL released for the whole of it."""

    def __init__(self, pool, methods: dict, type_index: int):
        self._pool = pool
        self._methods = methods  # the FFI function objects: keep the handles below alive
        self._fill_handle = methods["fill_next_token_bitmask"].__chandle__()
        self._accept_handle = methods["accept_token"].__chandle__()
        self._rollback_handle = methods["rollback"].__chandle__()
        self._type_index = type_index
        self.workers = pool.workers

    @classmethod
    def create(cls, workers: int) -> Optional["NativeFill"]:
        try:
            from xgrammar.tvm_ffi_binding._ffi_api import GrammarMatcher as FfiMatcher

            from .._native import MaskFillPool
            info = FfiMatcher.__tvm_ffi_type_info__
            methods = {m.name: m.func for m in info.methods if m.name in _METHODS}
            missing = _METHODS.difference(methods)
            if missing:
                raise AttributeError(f"xgrammar's GrammarMatcher has no FFI method {sorted(missing)}")
            pool = MaskFillPool(workers, *_ffi_entry_points())
        except Exception as e:  # noqa: BLE001 - any layout we do not know: use xgrammar's batch matcher
            log.info("native grammar fill unavailable (%s: %s); using xgrammar's batch matcher",
                     type(e).__name__, e)
            return None
        return cls(pool, methods, info.type_index)

    def helpers_for(self, rows: int, rows_per_thread: int) -> int:
        """Pool threads beside the caller for `rows` rows: one thread per `rows_per_thread`."""
        return max(0, min(self.workers, math.ceil(rows / rows_per_thread) - 1))

    def prepare(self, matchers: Sequence, bitmask: torch.Tensor, rows: Sequence[int],
                tokens: Sequence[int] | None = None) -> "PoolFill":
        """The fill of bitmask[rows[i]] from matchers[i] (RequestMatchers), its arguments converted
        for the pool: `PoolFill.run` makes it (dropping the GIL at once), or `start` and `finish`
        with other work between. With `tokens`, matchers[i] first accepts tokens[i] (none where -1),
        and rows[i] may be -1 (no row): the overlapped decode step's accepts of the step before ride
        along with its fill (`PoolFill.refused` lists the refused ones once finished)."""
        _check_bitmask(bitmask)
        accept = None if tokens is None else (self._accept_handle, np.asarray(tokens, dtype=np.int32))
        return PoolFill(self._pool, self._fill_handle, self._type_index, matchers, bitmask, rows, accept)

    def accept(self, matchers: Sequence, tokens: Sequence[int], helpers: int) -> list[int]:
        """matchers[i] accepts tokens[i], on up to `helpers` pool threads beside this one (the GIL
        released); returns the positions whose token the grammar refused (those matchers are
        unchanged), as `backend.batch_accept` does on one thread."""
        n = len(matchers)
        handles = _handles(matchers)
        ids = np.asarray(tokens, dtype=np.int32)
        accepted = np.empty(n, dtype=np.int8)
        self._pool.accept(self._accept_handle, self._type_index, handles, ids, accepted, helpers)
        if accepted.all():
            return []
        return np.flatnonzero(accepted == 0).tolist()

    def chains_call(self, matchers: Sequence, chains: Sequence[Sequence[int]], bitmask: torch.Tensor,
                    first_rows: Sequence[int], stop_ids: frozenset, helpers: int) -> Callable[[], None]:
        """A speculative step's rows for draft chains, prepared for later (what
        `backend.chain_fill_call` does, a chain per thread at a time): matchers[i], which has taken
        chains[i][0], fills row first_rows[i] + d after accepting chains[i][1:d + 1], for every
        d < len(chains[i]), and is rolled back at the end; a chain whose last token is one of
        `stop_ids` (it ends the grammar) leaves the row after it alone. The call raises
        RuntimeError(REFUSED_DRAFT) if a chain token was refused (those matchers are rolled back)."""
        _check_bitmask(bitmask)
        n = len(matchers)
        handles = _handles(matchers)
        lengths = np.fromiter((len(c) for c in chains), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate([np.asarray(c, dtype=np.int32) for c in chains]) if n else np.zeros(0, np.int32)
        skip_last = np.fromiter((len(c) > 1 and int(c[-1]) in stop_ids for c in chains), dtype=np.int8, count=n)
        rows = np.asarray(first_rows, dtype=np.int64)
        ok = np.empty(n, dtype=np.int8)
        pool, ptr, num_rows, width = self._pool, bitmask.data_ptr(), bitmask.shape[0], bitmask.shape[1]
        methods = (self._fill_handle, self._accept_handle, self._rollback_handle, self._type_index)

        def run() -> None:
            pool.fill_chains(*methods, handles, offsets, tokens, skip_last, rows, ptr, num_rows, width, ok, helpers)
            if not ok.all():  # (the closure holds `matchers`: the FFI handles stay alive through the call)
                raise RuntimeError(f"{REFUSED_DRAFT} ({len(matchers) - int(ok.sum())} of {len(matchers)} chains)")
        return run


class PoolFill:
    """A fill of bitmask rows on the pool (`NativeFill.prepare`), with the accepts before it where it
    has tokens. It holds what the pool's threads read (the matchers, whose FFI handles they use, and
    the arrays) for as long as it lives."""

    def __init__(self, pool, method: int, type_index: int, matchers: Sequence, bitmask: torch.Tensor,
                 rows: Sequence[int], accept: tuple[int, np.ndarray] | None = None):
        self._pool = pool
        self._rows = np.asarray(rows, dtype=np.int64)
        self._args = (method, type_index, _handles(matchers), self._rows, bitmask.data_ptr(), bitmask.shape[0],
                      bitmask.shape[1])
        self._accepted = None if accept is None else np.ones(len(matchers), dtype=np.int8)
        self._accept_args = () if accept is None else (accept[0], accept[1], self._accepted)
        self._matchers = matchers
        self._bitmask = bitmask
        self._running = False

    def start(self, helpers: int) -> None:
        """Wakes up to `helpers` pool threads on the rows and returns at once. Until `finish` the
        pool takes no other job, and the rows' matchers belong to the fill."""
        self._pool.fill_start(*self._args, helpers, *self._accept_args)
        self._running = True

    def finish(self) -> None:
        """Fills the rows no pool thread took yet and waits for the rest (the GIL released); a row
        whose xgrammar call failed is redone through xgrammar's Python API, which raises its error.
        Once is enough: again is a no-op."""
        if not self._running:
            return
        self._running = False
        failed = self._pool.fill_finish()
        if failed >= 0:
            self._matchers[failed].fill_bitmask(self._bitmask, int(self._rows[failed]))

    def run(self, helpers: int) -> None:
        """The whole fill, this thread filling beside up to `helpers` pool threads."""
        self.start(helpers)
        self.finish()

    def refused(self) -> list[int]:
        """After `finish`: the positions whose token the grammar refused (those matchers are as they
        were, and filled their row from there)."""
        if self._accepted is None or self._accepted.all():
            return []
        return np.flatnonzero(self._accepted == 0).tolist()
