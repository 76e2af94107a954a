"""What a request's grammar state offers the engine, whichever backend compiled its grammar.

`RequestMatcher` is the interface the engine, the mask filler and the speculative drafts use; one
implementation per backend (`xgrammar_backend.XGrammarMatcher`, `llguidance_backend.LLGuidanceMatcher`).
Both fill bitmask rows in the same layout: int32 words, bit `t & 31` of word `t >> 5` set where token
t is legal. A matcher is not thread-safe: one thread at a time uses it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Sequence

import torch

# A chain fill whose chain the grammar refuses (a bug: guided chains are legal by construction)
# raises this; the matchers are left where the walk stopped, and the engine fails the running requests.
REFUSED_DRAFT = "a draft chain token was refused by its grammar"


class RequestMatcher(ABC):
    """Per-request grammar state. `backend` names the implementation ("xgrammar", "llguidance")."""

    backend: str = ""
    compiled = None  # the CompiledGrammar it matches

    @abstractmethod
    def accept_token(self, tok: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it. Special tokens
        other than the grammar's stop tokens are always refused."""

    def accept_tokens(self, toks: Sequence[int]) -> int:
        """Accept a prefix of toks; returns how many were accepted (stops at the first illegal)."""
        n = 0
        for t in toks:
            if not self.accept_token(t):
                break
            n += 1
        return n

    def never_accepts(self, tok: int) -> bool:
        """True for a token refused in every state (a special, an id past the vocabulary), which a
        draft walk (`walks.py`) passes as refused without asking the grammar."""
        return False

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens legal next into bitmask[row] (every word of the row)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True when a stop token (EOS) is legal now, or the grammar already ended."""

    @abstractmethod
    def reset(self) -> None:
        ...

    def error(self) -> str | None:
        """Why the matcher can go no further where the backend failed rather than the grammar
        refused (llguidance's parser limits: a schema too wide for it), else None."""
        return None

    @abstractmethod
    def fork(self) -> "RequestMatcher":
        """An independent copy in the same state."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The text the grammar forces next ("" for none, or where it would start inside a UTF-8
        character)."""

    def jump_forward_tokens(self, tokenizer) -> List[int]:
        """Tokens of the string the grammar forces from here, each legal in sequence.

        Does not advance this matcher. The tokens are the tokenizer's encoding of the forced
        string, truncated at the first token the grammar refuses (checked on a fork)."""
        s = self.jump_forward_string()
        if not s:
            return []
        ids = tokenizer.encode(s, add_special_tokens=False)
        fork = self.fork()
        return [int(t) for t in ids[:fork.accept_tokens(ids)]]

    @abstractmethod
    def traverse_draft_tree(self, retrieve_next_token, retrieve_next_sibling, draft_tokens,
                            bitmask: torch.Tensor, time_threshold: float = -1.0) -> bool:
        """Fill bitmask row i for every node i of a draft tree (xgrammar's layout: node 0 is the
        last verified token, already accepted into this matcher; row i holds the tokens legal
        after the path root..i). Nodes whose token the grammar forbids are not descended into
        (their rows and their subtree's rows are left as they were: `legal_draft_nodes` prunes
        them). The matcher state is unchanged afterwards. Returns False if time_threshold
        (seconds, >0) was exceeded."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.compiled.spec.kind if self.compiled else None}, "
                f"terminated={self.is_terminated()})")


def as_i64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.int64 or x.device.type != "cpu":
            x = x.to("cpu", torch.int64)
        return x.contiguous()
    return torch.tensor(list(x), dtype=torch.int64)


def legal_draft_nodes(bitmask: torch.Tensor, retrieve_next_token, retrieve_next_sibling,
                      draft_tokens) -> List[bool]:
    """After traverse_draft_tree: legal[i] is True when the path root..i is grammar-legal."""
    rnt = [int(v) for v in retrieve_next_token]
    rns = [int(v) for v in retrieve_next_sibling]
    dt = [int(v) for v in draft_tokens]
    legal = [False] * len(dt)
    legal[0] = True
    stack = [0]
    bm = bitmask
    while stack:
        i = stack.pop()
        c = rnt[i]
        while c != -1:
            t = dt[c]
            if (int(bm[i, t >> 5]) >> (t & 31)) & 1:
                legal[c] = True
                stack.append(c)
            c = rns[c]
    return legal
