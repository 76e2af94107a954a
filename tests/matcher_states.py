"""Shared by the mask-fill tests: a grammar backend on SmolLM2's tokenizer, matchers at successive
states of a valid text, and the wait for an engine's KV pool to drain."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from constrained_spec.grammar import GrammarBackend, GrammarSpec


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    b = GrammarBackend(tok, 49152, max_whitespace_cnt=16, default_backend="xgrammar")
    yield SimpleNamespace(grammar=b, tokenizer=tok)
    b.close()


def matchers_along(backend, spec: GrammarSpec, text: str, n: int):
    """(n matchers at successive states along a valid text (its first n token prefixes), its ids)."""
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    compiled = backend.grammar.compile(spec)
    out = []
    for k in range(n):
        m = backend.grammar.matcher(compiled)
        assert m.accept_tokens(ids[:k]) == k
        out.append(m)
    return out, ids


def wait_pool_full(engine, timeout=5.0) -> None:
    """Finished requests give their KV slots back on the engine thread: wait until all are back."""
    pool = engine.runner.pool
    end = time.monotonic() + timeout
    while pool.num_free != pool.capacity and time.monotonic() < end:
        time.sleep(0.01)
    assert pool.num_free == pool.capacity


class SlowFills:
    """Fault injection for a pathological grammar, at the FFI boundary the native pool calls: the
    pool's fill method becomes a Python FFI function that sleeps `delay_s` before xgrammar's own
    fill for the matchers in `slow` (FFI handles), and fills the others at once. Install it on a
    MaskFiller with `install`; `mark(matcher)` makes a matcher slow."""

    def __init__(self, delay_s: float):
        import tvm_ffi
        self.delay_s = delay_s
        self.slow: set[int] = set()
        self.calls = 0
        self._function = tvm_ffi.convert(self._fill)
        self._real = None

    def _fill(self, matcher, bitmask, row, debug_print):
        self.calls += 1
        if matcher.__chandle__() in self.slow:
            time.sleep(self.delay_s)
        return self._real(matcher, bitmask, row, debug_print)

    def mark(self, matcher):
        self.slow.add(matcher.ffi_handle)
        return matcher

    def install(self, filler) -> None:
        native = filler._native
        self._real = native._methods["fill_next_token_bitmask"]
        native._fill_handle = self._function.__chandle__()
        native._methods["fault_injection"] = self._function  # keeps the handle alive with the pool
        if filler._staged is not None:
            filler._staged = native.staged_rows(filler._staging)
