"""Grammar bitmask rows, and token accepts, on persistent native threads (`native/mask_fill_pool.h`):
the engine's one parallel fill.

`NativeFill` makes xgrammar's own per-row calls (`GrammarMatcher.fill_next_token_bitmask`,
`accept_token`, `rollback`, through the TVM FFI C ABI that xgrammar's Python bindings use) from
threads that live as long as the engine, never taking the GIL: a step's token accepts (`accept`),
its bitmask rows (`prepare`, then `PoolFill.run`, or `start` and `finish` around other work), a
speculative step's draft rows (`walk_call`: chains, trees, EAGLE frontiers) and the budgeted fill's
rows (`StagedRows`), each filled on its own into a staging row. Persistent threads won over xgrammar's `BatchGrammarMatcher`,
which starts and joins its threads in every call: 128 rows of real JSON states fill in 0.11 ms here
against 0.52-0.96 ms there (H100 host, `benchmarks/bench_mask_fill.py`).
"""
from __future__ import annotations

import ctypes
import math
from typing import Callable, Sequence

import numpy as np
import torch

from .matcher import REFUSED_DRAFT
from .walks import Walks

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
        self.max_helpers = pool.workers

    @classmethod
    def create(cls, workers: int, max_helpers: int | None = None) -> "NativeFill":
        """A pool of `workers` threads, of which a job takes up to `max_helpers` (all by default);
        the others only serve queued rows (`StagedRows`). Raises RuntimeError where xgrammar's FFI
        layout is not the one this build knows (xgrammar is pinned in pyproject.toml)."""
        try:
            from xgrammar.tvm_ffi_binding._ffi_api import GrammarMatcher as FfiMatcher

            from .._native import MaskFillPool
            info = FfiMatcher.__tvm_ffi_type_info__
            methods = {m.name: m.func for m in info.methods if m.name in _METHODS}
            missing = _METHODS.difference(methods)
            if missing:
                raise AttributeError(f"xgrammar's GrammarMatcher has no FFI method {sorted(missing)}")
            pool = MaskFillPool(workers, *_ffi_entry_points())
        except Exception as e:  # noqa: BLE001 - reported with what to do
            raise RuntimeError(
                f"the native grammar fill pool cannot be built ({type(e).__name__}: {e}); it needs the "
                "project's native extension (pip install -e .) and the xgrammar version pinned in "
                "pyproject.toml") from e
        fill = cls(pool, methods, info.type_index)
        fill.max_helpers = workers if max_helpers is None else min(workers, max_helpers)
        return fill

    def helpers_for(self, rows: int, rows_per_thread: int) -> int:
        """Pool threads beside the caller for `rows` rows: one thread per `rows_per_thread`."""
        return max(0, min(self.max_helpers, math.ceil(rows / rows_per_thread) - 1))

    def staged_rows(self, staging: torch.Tensor) -> "StagedRows":
        """Queued fills into the rows of `staging` (one pool per staging buffer)."""
        return StagedRows(self, staging)

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
        unchanged)."""
        n = len(matchers)
        handles = _handles(matchers)
        ids = np.asarray(tokens, dtype=np.int32)
        accepted = np.empty(n, dtype=np.int8)
        self._pool.accept(self._accept_handle, self._type_index, handles, ids, accepted, helpers)
        if accepted.all():
            return []
        return np.flatnonzero(accepted == 0).tolist()

    def walk_call(self, matchers: Sequence, walks: Walks, bitmask: torch.Tensor, helpers: int) -> Callable[[], np.ndarray]:
        """Matchers[i] walks walks' walk i (`grammar/walks.py`), prepared for later, a walk per pool
        thread at a time; the call returns `ok`, 0 where a walk met a token its grammar refused.
        Raises RuntimeError if a row's fill failed."""
        _check_bitmask(bitmask)
        handles = _handles(matchers)
        ok = np.empty(len(matchers), dtype=np.int8)
        pool, ptr, num_rows, width = self._pool, bitmask.data_ptr(), bitmask.shape[0], bitmask.shape[1]
        methods = (self._fill_handle, self._accept_handle, self._rollback_handle, self._type_index)

        def run() -> np.ndarray:
            # (the closure holds `matchers` and `walks`: the handles and arrays live through the call)
            failed = pool.walk(*methods, handles, walks.offsets, walks.back, walks.tokens, walks.rows, ptr,
                               num_rows, width, ok, helpers)
            if failed >= 0:
                raise RuntimeError(f"a grammar bitmask fill failed in a draft walk ({matchers[failed].backend})")
            return ok
        return run

    def chains_call(self, matchers: Sequence, chains: Sequence[Sequence[int]], bitmask: torch.Tensor,
                    first_rows: Sequence[int], stop_ids: frozenset, helpers: int,
                    partial: bool = False) -> Callable[[], None]:
        """A speculative step's rows for draft chains (`Walks.of_chains`): matchers[i], which has taken
        chains[i][0], fills row first_rows[i] + d after accepting chains[i][1:d + 1], for every
        d < len(chains[i]), and is rolled back at the end; a chain's walk ends at its first token of
        `stop_ids` (it ends the grammar): the rows after it are zeroed. The call raises
        RuntimeError(REFUSED_DRAFT) if a chain token was refused, unless `partial`: then the rows
        from the refused token on are zeroed. Every matcher ends where it was."""
        walks, ended = Walks.of_chains(chains, first_rows, stop_ids)
        walk = self.walk_call(matchers, walks, bitmask, helpers)

        def run() -> None:
            if ended:
                bitmask[ended] = 0
            ok = walk()
            if not (partial or ok.all()):
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


class StagedRows:
    """Fills queued on the pool, each into its own row of a staging bitmask, for the budgeted fill:
    `submit` queues rows, `wait` waits for some of them until a deadline, and `done` / `seconds`
    say which are in and how long each took. A queued row's matcher belongs to its fill until its
    row is done; the caller keeps the matcher alive until then."""

    def __init__(self, native: NativeFill, staging: torch.Tensor):
        _check_bitmask(staging)
        self._pool = native._pool
        self._staging = staging
        self.done = np.zeros(staging.shape[0], dtype=np.int8)
        self.seconds = np.zeros(staging.shape[0], dtype=np.float64)
        self._pool.set_staging(native._fill_handle, native._type_index, staging.data_ptr(), staging.shape[0],
                               staging.shape[1], self.done, self.seconds)

    def submit(self, matchers: Sequence, rows: Sequence[int]) -> None:
        """Queues matchers[i]'s fill of staging row rows[i], in this order."""
        slots = np.asarray(rows, dtype=np.int64)
        self.done[slots] = 0
        self._pool.submit(_handles(matchers), slots, self._staging.shape[0])

    def wait(self, rows: Sequence[int], timeout_s: float | None) -> np.ndarray:
        """Waits (the GIL released) until these rows are done or `timeout_s` has passed (None: no
        limit); returns which are done, a snapshot."""
        slots = np.asarray(rows, dtype=np.int64)
        self._pool.wait_rows(slots, -1.0 if timeout_s is None else max(0.0, timeout_s))
        return self.done[slots] != 0
