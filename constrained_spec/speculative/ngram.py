"""N-gram lookahead drafter over the native trie (``constrained_spec._native.NgramTrie``).

One trie is shared by all requests (prompts and outputs, frequency counts, LRU-leaf eviction at
``capacity`` nodes); each request also has its own small trie whose continuations rank first.
Drafts are deterministic (no draft distribution): the engine verifies them by path matching against
the target's greedy or seeded draws (`worker.py`), the single-token case of
``rejection_verify(..., draft_probs=None)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from .drafter import DraftBatch, Drafter
from .tree import DraftTrees

__all__ = ["NgramConfig", "NgramDrafter"]


@dataclass
class NgramConfig:
    max_ngram: int = 8  # longest context suffix matched
    min_ngram: int = 1  # shortest suffix accepted as a match
    num_draft_tokens: int = 8  # tree width N, root included
    branches: int = 1  # children per draft node; 1 = chain, >1 = tree
    capacity: int = 1 << 19  # shared trie nodes
    request_capacity: int = 1 << 16  # per-request trie nodes
    window: int = 0  # tokens stored per position; 0 = max_ngram + num_draft_tokens - 1


class NgramDrafter(Drafter):
    has_next_tokens = True

    def __init__(self, config: NgramConfig | None = None, **overrides):
        import torch  # noqa: F401  first: the native module then shares torch's OpenMP runtime (setup.py)
        from constrained_spec._native import NgramTrie  # built by `pip install -e .`

        cfg = config or NgramConfig()
        if overrides:
            cfg = NgramConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self.num_draft_tokens = cfg.num_draft_tokens
        self.context_tokens = cfg.max_ngram
        self.trie = NgramTrie(max_ngram=cfg.max_ngram, min_ngram=cfg.min_ngram,
                              num_draft_tokens=cfg.num_draft_tokens, branches=cfg.branches,
                              capacity=cfg.capacity, request_capacity=cfg.request_capacity,
                              window=cfg.window)
        self._ids: dict[Hashable, int] = {}
        self._next_id = 0

    def _id(self, request_id: Hashable) -> int:
        i = self._ids.get(request_id)
        if i is None:
            i = self._ids[request_id] = self._next_id
            self._next_id += 1
        return i

    def add_request(self, request_id: Hashable, prompt_tokens: Sequence[int]) -> None:
        self.trie.insert(self._id(request_id), np.asarray(prompt_tokens, dtype=np.int32))

    def add_prediction(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        self.trie.insert(self._id(request_id), np.asarray(tokens, dtype=np.int32))  # the prompt follows it

    def add_corpus(self, tokens: Sequence[int]) -> None:
        """Insert a standalone token stream into the shared trie (e.g. warm-up text)."""
        self.trie.insert(-1, np.asarray(tokens, dtype=np.int32))

    def propose(self, batch: DraftBatch, num_draft_tokens: int = 0, branches: int = 0) -> DraftTrees:
        return DraftTrees.from_arrays(*self._propose(batch, num_draft_tokens, branches))

    def propose_arrays(self, batch: DraftBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return tuple(x.astype(np.int64) for x in self._propose(batch, 0, 0))  # int32 -> fresh int64 copies

    def _propose(self, batch: DraftBatch, num_draft_tokens: int, branches: int):
        ids = np.fromiter((self._id(r) for r in batch.request_ids), dtype=np.int64, count=len(batch))
        contexts = None
        if batch.contexts is not None:
            k = self.config.max_ngram
            contexts = [np.asarray(c[-k:], dtype=np.int32) for c in batch.contexts]
        return self.trie.propose_batch(ids, contexts, num_draft_tokens, branches)

    def next_tokens(self, request_id: Hashable, context: Sequence[int], k: int) -> Sequence[int]:
        return self.trie.next_tokens(self._id(request_id), list(context[-self.context_tokens:]), k)

    def observe(self, request_id: Hashable, accepted_tokens: Sequence[int]) -> None:
        self.trie.insert(self._id(request_id), np.asarray(accepted_tokens, dtype=np.int32))

    def observe_batch(self, request_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        ids = np.fromiter((self._id(r) for r in request_ids), dtype=np.int64, count=len(request_ids))
        self.trie.insert_batch(ids, [np.asarray(t, dtype=np.int32) for t in token_lists])

    def finish(self, request_id: Hashable) -> None:
        i = self._ids.pop(request_id, None)
        if i is not None:
            self.trie.remove_request(i)
