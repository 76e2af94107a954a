"""A debugging aid for "an answer the grammar should have prevented": `CONSTRAINED_SPEC_AUDIT_MASKS=1`
in the engine's environment turns on two checks that say where such an answer came from.

* Each masked decode step, before its tokens are accepted: is every grammar request's sampled token
  allowed by the bitmask row the host filled for it? A token outside its row means the device
  sampled under another mask than the host's (copy ordering, row placement, a graph's stale input).
* As each grammar request ends: does a fresh matcher accept its whole output? A refusal where the
  live matcher accepted means the live matcher's state drifted from the output (an accept missed or
  doubled) or a different grammar was in use.

Both only log (`ERROR`, naming the request, backend, position and text); the run goes on. Off by
default: the first check reads the bitmask rows of every step, the second replays every answer.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

ENV = "CONSTRAINED_SPEC_AUDIT_MASKS"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def outside_rows(bitmask: torch.Tensor, positions: list[int], tokens: list[int]) -> list[int]:
    """The positions i (among `positions`) whose tokens[i] has a 0 bit in bitmask row i."""
    if not positions:
        return []
    pos = np.asarray(positions, dtype=np.int64)
    tok = np.asarray([tokens[i] for i in positions], dtype=np.int64)
    words = bitmask.numpy()[pos, tok >> 5].astype(np.int64) & 0xFFFFFFFF
    allowed = (words >> (tok & 31)) & 1
    return [int(p) for p in pos[allowed == 0]]


class MaskAudit:
    def __init__(self, grammar, tokenizer):
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.steps_checked = 0
        self.outside = 0
        self.replays = 0
        self.diverged = 0

    def check_step(self, reqs, positions: list[int], tokens: list[int], bitmask: torch.Tensor, where: str) -> None:
        """Before the step's accepts: `positions` are the grammar requests that sampled under
        bitmask rows [:len(reqs)] (still the step's: the next fill has not started)."""
        self.steps_checked += 1
        for i in outside_rows(bitmask, positions, tokens):
            self.outside += 1
            req = reqs[i]
            log.error("mask audit (%s): request %s sampled token %d %r outside its host row %d (%s backend, %d tokens "
                      "in, ending %r)", where, req.request_id, tokens[i], self.tokenizer.decode([tokens[i]]), i,
                      req.matcher.backend, len(req.output_ids), self.tokenizer.decode(req.output_ids[-30:]))

    def replay(self, req, reason: str) -> None:
        """A fresh matcher over the ended request's output (a final grammar stop token included): one
        that shares no state with the requests' (`GrammarBackend.fresh_matcher`), since a copy of an
        llguidance template that only consumes can refuse valid text after others filled masks."""
        m = req.matcher
        if m is None or reason not in ("stop", "length"):
            return
        self.replays += 1
        fresh = self.grammar.fresh_matcher(m.compiled)
        out = list(req.output_ids)
        taken = fresh.accept_tokens(out)
        if taken == len(out):
            return
        self.diverged += 1
        log.error("mask audit: request %s (%s backend, %s grammar) ended '%s' with output a fresh matcher refuses "
                  "at token %d/%d %r after %r", req.request_id, m.backend, m.compiled.spec.kind, reason,
                  taken, len(out), self.tokenizer.decode(out[taken:taken + 1]),
                  self.tokenizer.decode(out[max(0, taken - 40):taken]))
