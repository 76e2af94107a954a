"""Grammar-guided drafting (speculative/grammar_draft.py) with the real SmolLM2 tokenizer, real xgrammar
matchers and the native n-gram drafter."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from constrained_spec.grammar import GrammarBackend, GrammarSpec
from constrained_spec.speculative.grammar_draft import guided_chain, stable_forced_tokens, write_chain
from constrained_spec.speculative.ngram import NgramDrafter

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "country", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, vocab_size=len(tokenizer) + 64)
    yield b
    b.close()


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def bitmask_of(backend, matcher):
    bm = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bm, 0)
    return bm.clone()


def legal_sequence(backend, compiled, prefix, chain):
    m = backend.matcher(compiled)
    assert m.accept_tokens(prefix) == len(prefix)
    return m.accept_tokens(chain) == len(chain)


def test_stable_forced_tokens_keep_all_but_the_last(backend, tokenizer):
    m = backend.matcher(backend.compile(GrammarSpec.regex(r'\{"population": [0-9]+\}')))
    stable, first = stable_forced_tokens(m, tokenizer)
    full = encode(tokenizer, '{"population": ')
    assert stable == full[:-1] and first == full[0]
    assert m.accept_tokens(full) == len(full)
    assert stable_forced_tokens(m, tokenizer) == ([], None)  # digits are free


def test_guided_chain_is_legal_and_leaves_the_matcher_unchanged(backend, tokenizer):
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA))
    example = '{"city": "Paris", "country": "France", "population": 2100000}'
    prompt = encode(tokenizer, f"Example: {example} Another one:")
    drafter = NgramDrafter(num_draft_tokens=16)
    drafter.add_request("r", prompt)
    out = encode(tokenizer, '{"city": "Lyon", "country": "')  # the model's tokens so far
    drafter.observe("r", out)
    m = backend.matcher(compiled)
    assert m.accept_tokens(out) == len(out)
    before = bitmask_of(backend, m)
    chain, forced = guided_chain(m, tokenizer, lambda ctx, k: drafter.next_tokens("r", ctx, k), prompt + out, 15)
    assert torch.equal(bitmask_of(backend, m), before)  # rolled back
    assert 0 < len(chain) <= 15 and forced >= 0
    assert legal_sequence(backend, compiled, out, chain)
    # the trie has seen `"country": "France"` right after `"country": "`
    assert tokenizer.decode(chain).startswith("France")


def test_guided_chain_takes_the_first_legal_candidate(backend, tokenizer):
    """The trie's favourite continuation is illegal here; the next one is taken."""
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA))
    drafter = NgramDrafter(num_draft_tokens=8)
    # after `":` the prompt mostly continues with ` {"` (nested schemas), once with ` 7`
    drafter.add_request("r", encode(tokenizer, 'a": {"x a": {"y a": {"z a": 7, "b'))
    out = encode(tokenizer, '{"city": "A", "country": "B", "population":')
    m = backend.matcher(compiled)
    assert m.accept_tokens(out) == len(out)
    ranked = drafter.next_tokens("r", out, 3)
    assert len(ranked) >= 2 and tokenizer.decode(ranked[0]).startswith(" {")  # illegal for an integer
    chain, _ = guided_chain(m, tokenizer, lambda ctx, k: drafter.next_tokens("r", ctx, k), out, 7)
    assert tokenizer.decode(chain).startswith(" 7")
    assert legal_sequence(backend, compiled, out, chain)


def test_guided_chain_without_candidates_uses_the_forced_string(backend, tokenizer):
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA))
    m = backend.matcher(compiled)
    out = encode(tokenizer, '{"')
    assert m.accept_tokens(out) == len(out)
    chain, forced = guided_chain(m, tokenizer, lambda ctx, k: [], out, 7)
    assert forced == len(chain) > 0
    assert tokenizer.decode(chain).startswith("city")
    assert legal_sequence(backend, compiled, out, chain)


def test_write_chain_layout():
    tokens, nxt, sib = np.zeros((2, 5), np.int64), np.full((2, 5), 3, np.int64), np.full((2, 5), 3, np.int64)
    num = np.full(2, 5, np.int64)
    tokens[1, 0] = 42
    write_chain(tokens, nxt, sib, num, 1, [7, 8])
    assert tokens[1].tolist() == [42, 7, 8, 0, 0]
    assert nxt[1].tolist() == [1, 2, -1, -1, -1] and sib[1].tolist() == [-1] * 5 and num[1] == 3
    assert nxt[0].tolist() == [3] * 5  # other rows untouched
