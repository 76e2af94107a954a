"""Shared by the mask-fill tests: a grammar backend on SmolLM2's tokenizer, and matchers at
successive states of a valid text."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from constrained_spec.grammar import GrammarBackend, GrammarSpec


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    b = GrammarBackend(tok, 49152, max_whitespace_cnt=16)
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
