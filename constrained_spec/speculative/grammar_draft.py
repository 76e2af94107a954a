"""Grammar-guided drafts: a chain built by the grammar and the drafter in turn.

For a request with a grammar, the draft is built one position at a time against its matcher:
  * where the grammar forces a string (a JSON key, the rest of `"name"`), its tokens are certain
    and go in first; all but the last token of the string's encoding, because the model may
    tokenize that last piece together with what follows (`"` + `:` is one token, `":`, in most
    vocabularies) and a draft token the model would not emit is a wasted position;
  * elsewhere the drafter's best next tokens for the chain so far are tried in rank order, and the
    first one the grammar accepts is taken (the trie's favourite after ` "` is often a key of the
    prompt's schema that is not legal here, while its second is);
  * the chain stops at `max_len`, or where no candidate is legal.
Every token is accepted into the matcher as it is drafted and all of them are rolled back at the
end, so the matcher is where it was. Over SmolLM2's greedy outputs for the 30 hand-written schemas
this raises the mean accepted length of an 8-token draft from 2.4 (a trie chain, forced strings as
whole chains) to 3.0.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import numpy as np

__all__ = ["CANDIDATES", "guided_chain", "stable_forced_tokens", "write_chain"]

# drafter candidates tried per draft position
CANDIDATES = 3


# Encodings of forced strings, per tokenizer: the same few (a schema's keys and punctuation) come
# back in every request and step, and an encode costs ~18 us (CPU, SmolLM2's tokenizer).
_ENCODED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ENCODED_MAX = 16384  # strings per tokenizer


def _encode(tokenizer, text: str) -> list[int]:
    cache = _ENCODED.get(tokenizer)
    if cache is None:
        cache = _ENCODED[tokenizer] = {}
    ids = cache.get(text)
    if ids is None:
        fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no Python wrapper cost
        ids = (fast.encode(text, add_special_tokens=False).ids if fast is not None
               else tokenizer.encode(text, add_special_tokens=False))
        if len(cache) >= _ENCODED_MAX:
            cache.clear()
        cache[text] = ids
    return ids


def stable_forced_tokens(matcher, tokenizer) -> tuple[list[int], int | None]:
    """(the tokens of the forced string but its last, the first token of the string): the first
    list is what can be drafted with confidence; the second is a fallback when nothing else is
    legal. ([], None) when the grammar forces nothing here."""
    text = matcher.jump_forward_string()
    if not text:
        return [], None
    ids = _encode(tokenizer, text)
    return ids[:-1], (ids[0] if ids else None)


def guided_chain(matcher, tokenizer, next_tokens: Callable[[Sequence[int], int], Sequence[int]],
                 context: Sequence[int], max_len: int) -> tuple[list[int], int]:
    """Draft up to `max_len` tokens after `context` (whose last token the matcher has accepted).

    next_tokens(context, k): the drafter's k best next tokens after `context`, best first.
    Returns (chain, how many of its tokens the grammar forced). The matcher is left unchanged."""
    chain: list[int] = []
    forced_count = 0
    ctx = list(context)
    try:
        while len(chain) < max_len:
            forced, fallback = stable_forced_tokens(matcher, tokenizer)
            forced = forced[:max_len - len(chain)]
            took = matcher.accept_tokens(forced)
            chain += forced[:took]
            if took:
                forced_count += took
                continue
            picked = next((t for t in next_tokens(ctx + chain, CANDIDATES) if matcher.accept_token(t)), None)
            if picked is None and fallback is not None and matcher.accept_token(fallback):
                picked = fallback
                forced_count += 1
            if picked is None:
                break
            chain.append(int(picked))
            if matcher.is_terminated():
                break
    finally:
        matcher.rollback(len(chain))
    return chain, forced_count


def write_chain(tokens: np.ndarray, next_token: np.ndarray, next_sibling: np.ndarray, num_nodes: np.ndarray,
                row: int, chain: Sequence[int]) -> None:
    """Replaces draft tree `row` of the [B, N] arrays (node 0 kept) by the chain `chain`."""
    n = len(chain) + 1
    tokens[row, 1:n], tokens[row, n:] = chain, 0
    next_token[row] = -1
    next_token[row, :n - 1] = np.arange(1, n)
    next_sibling[row] = -1
    num_nodes[row] = n
