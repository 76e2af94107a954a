"""The incremental detokenizer (fast path: the Rust tokenizer called directly) yields exactly what
the Hugging Face tokenizer decodes for the whole sequence, token by token and with stop strings."""
from __future__ import annotations

import random

import pytest

from constrained_spec.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from constrained_spec.models.loader import load_folder_tokenizer
    return load_folder_tokenizer(smollm2_dir)


def reference(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", ["Héllo wörld — ünïcode ✓ 日本語 🙂 {\"a\": [1, 2.5e-3]}\n\ttabs  and spaces",
                                  "<|im_end|> special tokens in the middle"])
def test_matches_full_decode_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
    pieces = []
    for i in ids:
        assert d.add([i]) is None
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == reference(tokenizer, ids)


def test_random_tokens_and_chunks(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(2000)]
    d = IncrementalDetokenizer(tokenizer, [5], [])
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        d.add(ids[i:i + n])
        i += n
    # byte-level pieces that never complete a character stay held back as U+FFFD at the very end only
    full = reference(tokenizer, ids)
    assert d.take(final=True) == full[:len(d.text)] and len(full) - len(d.text) <= 4


def test_stop_string_truncates(tokenizer):
    ids = tokenizer.encode("The answer is 42. STOP here and more", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1], ["STOP"])
    stop = None
    for i in ids:
        stop = d.add([i]) or stop
        if stop:
            break
    assert stop == "STOP" and d.take(final=True) == "The answer is 42. "
