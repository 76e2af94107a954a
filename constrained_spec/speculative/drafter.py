"""The drafter interface the engine talks to.

Protocol per request (the engine's side):
  1. ``add_request(rid, prompt_tokens)`` once, before the first ``propose`` (after
     ``add_prediction(rid, tokens)`` for a request with a predicted output);
  2. each step: ``propose(DraftBatch)`` -> :class:`DraftTrees` (node 0 of request b = the last
     verified token, i.e. the last token of its stream); verify; then
     ``observe(rid, emitted_tokens)`` with the tokens the step emitted (accepted drafts + bonus), so
     the drafter's stream is always prompt + every emitted token, in order;
  3. ``finish(rid)`` when the request ends (any reason).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from .tree import DraftTrees

__all__ = ["DraftBatch", "Drafter"]


@dataclass
class DraftBatch:
    """What ``propose`` needs: the requests, in batch order.

    contexts: None (the drafter uses the streams it was given through add_request/observe), or one
    token sequence per request whose last token is node 0 (only the tail is read, e.g. the last
    ``max_ngram`` tokens for the n-gram drafter).
    """
    request_ids: list[Hashable]
    contexts: list[Sequence[int]] | None = None
    #: the engine's requests themselves (row, cached length, tokens, matcher), for drafters that
    #: work on the engine's state (`Drafter.needs_requests`)
    requests: list | None = None

    def __len__(self) -> int:
        return len(self.request_ids)


class Drafter(ABC):
    #: tree width N, root included: every returned tree has at most N nodes and the batch is padded
    #: to [B, N] (the static verify width for CUDA graphs).
    num_draft_tokens: int
    #: whether `next_tokens` works: then requests with a grammar get grammar-guided chains
    #: (`grammar_draft.py`) instead of `propose`'s trees
    has_next_tokens: bool = False
    #: trailing context tokens `next_tokens` reads (callers pass no more than this)
    context_tokens: int = 8
    #: whether `propose` reads `DraftBatch.requests` (the EAGLE drafter: KV rows, grammar matchers)
    needs_requests: bool = False
    #: whether the worker drafts this drafter's chains after each verify, in the same launch
    #: (`chain_step.py`: the EAGLE drafter at top-1); `propose` then drafts only for requests that
    #: have no chain from the step before, and `saw` hears which requests the head is caught up on
    fuses_chains: bool = False

    def add_prediction(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Text the request's answer is expected to repeat (OpenAI's Predicted Outputs), before its
        prompt: a drafter that drafts from what it has seen may draft from it too."""

    def add_request(self, request_id: Hashable, prompt_tokens: Sequence[int]) -> None:
        """Register a request and its prompt."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> DraftTrees:
        """Draft one tree per request: DraftTrees of [B, N] int64 CPU tensors."""

    def propose_arrays(self, batch: DraftBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The same drafts as fresh, writable numpy int64 arrays (tokens, next_token, next_sibling
        [B, N]; num_nodes [B]): what the speculative step works on. Override to skip the tensors."""
        t = self.propose(batch)
        return tuple(x.numpy().astype(np.int64) for x in (t.tokens, t.next_token, t.next_sibling, t.num_nodes))

    def next_tokens(self, request_id: Hashable, context: Sequence[int], k: int) -> Sequence[int]:
        """Up to k likely next tokens after `context` (the tail of the request's stream, perhaps
        followed by drafted tokens), best first: what grammar-guided drafting picks from
        (`grammar_draft.py`). Only called when `has_next_tokens` is set."""
        raise NotImplementedError

    def observe(self, request_id: Hashable, accepted_tokens: Sequence[int]) -> None:
        """Append the tokens emitted by the last verify step (accepted drafts + bonus)."""

    def observe_batch(self, request_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        for rid, toks in zip(request_ids, token_lists):
            self.observe(rid, toks)

    def filled_rows(self):
        """Grammar rows the last `propose_arrays` filled for its trees' nodes while drafting (the
        verify tree needs the same rows): (rows [R, W] int32 numpy array, [B, N] int64 each node's
        row in it or -1), or None. Taken once: the next call returns None."""
        return None

    def use_mask_filler(self, filler) -> None:
        """The engine's grammar pool (`MaskFiller`), for drafters that fill bitmask rows while they
        draft; the others ignore it."""

    @staticmethod
    def wait_for_device(wait):
        """`wait()`: a read of the device's results in the middle of drafting. The worker puts the
        engine's `stats.wait_for_device` here, so that the loop's device-wait figure counts them."""
        return wait()

    def finish(self, request_id: Hashable) -> None:
        """Drop the request's state."""

    def reset(self) -> bool:
        """Forget every request in place; False when the drafter cannot (the worker makes a new one)."""
        return False
