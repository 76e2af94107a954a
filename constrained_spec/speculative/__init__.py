"""Speculative decoding: draft trees, drafters and verification."""
from .drafter import DraftBatch, Drafter
from .tree import DraftTrees, HostTrees, allowed_from_bitmask
from .verify import (HostAcceptance, VerifyResult, greedy_accept_host, greedy_verify, rejection_verify,
                     sample_from_probs)

__all__ = ["DraftBatch", "Drafter", "DraftTrees", "HostAcceptance", "HostTrees", "VerifyResult",
           "allowed_from_bitmask", "greedy_accept_host", "greedy_verify", "rejection_verify", "sample_from_probs",
           "NgramDrafter", "NgramConfig"]


def __getattr__(name):  # the n-gram drafter needs the native extension: import it lazily
    if name in ("NgramDrafter", "NgramConfig"):
        from . import ngram
        return getattr(ngram, name)
    raise AttributeError(name)
