"""Speculative decoding, called by the engine: drafters, draft trees, verification, and the step.

  worker.py         `SpeculativeWorker`: the engine's speculative step (draft, mask, verify, commit)
  policy.py         `MeasuredPolicy`: speculate or decode plainly, by measured throughput
  verify_step.py    `VerifyIO`, `VerifyLaunch`: the verify step's static buffers and device launches
  verify.py         acceptance math: greedy and rejection verification of draft trees
  tree.py           draft trees (`DraftTrees` on the device, `HostTrees` in numpy)
  drafter.py        the `Drafter` interface
  ngram.py          `NgramDrafter`, over the native n-gram trie
  grammar_draft.py  grammar-guided draft chains (forced tokens, ranked next tokens)
  eagle.py          `EagleDrafter`: EAGLE-2 draft trees from a head, grammar-masked while drafted
  eagle_step.py     `DraftIO`: the EAGLE draft steps' static buffers and device work (CUDA graphs)
"""
from .drafter import DraftBatch, Drafter
from .policy import MeasuredPolicy
from .tree import DraftTrees, HostTrees, allowed_from_bitmask
from .verify import (HostAcceptance, VerifyResult, greedy_accept_host, greedy_verify, rejection_verify,
                     sample_from_probs)
from .worker import SpeculativeWorker, make_drafter

__all__ = ["DraftBatch", "Drafter", "DraftTrees", "HostAcceptance", "HostTrees", "MeasuredPolicy",
           "SpeculativeWorker", "VerifyResult", "allowed_from_bitmask", "greedy_accept_host", "greedy_verify",
           "make_drafter", "rejection_verify", "sample_from_probs", "NgramDrafter", "NgramConfig"]


def __getattr__(name):  # the n-gram drafter needs the native extension: import it lazily
    if name in ("NgramDrafter", "NgramConfig"):
        from . import ngram
        return getattr(ngram, name)
    raise AttributeError(name)
