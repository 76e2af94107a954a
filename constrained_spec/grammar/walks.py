"""Depth-first walks of a grammar matcher through token trees: the bitmask rows of a speculative
step's draft nodes (a chain, a tree, an EAGLE frontier), filled on the native pool
(`NativeFill.walk`), or on the calling thread (`walk_paths_here`: llguidance's matchers, and a
pool without threads to spare).

A walk is a list of steps. A step rolls back `back` tokens of the walk's path, accepts `token`
(NO_TOKEN: none; REFUSED: one the matcher refuses without being asked, a special or
out-of-vocabulary id) and fills `row` (-1: none) for the path so far. A refused token and every
step below it, until a step rolls back above it, fill nothing: their rows are zeroed, as no token
follows an illegal path. The matcher ends where it started.

Draft nodes as paths (the tokens from the matcher's state to the node) make a walk by sorting:
sorted paths are a depth-first order, and each path rolls back only to the stem it shares with the
one before, so a common stem is accepted once (`WalkSteps.add_paths`). A request's paths may be
split into several walks (`split_paths`), each on a fork of its matcher, for the pool's threads to
share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

NO_TOKEN = -1
REFUSED = -2


@dataclass
class Walks:
    """Walk i is steps offsets[i]:offsets[i + 1] of (back, tokens, rows)."""
    offsets: np.ndarray  # int64 [n + 1]
    back: np.ndarray  # int32
    tokens: np.ndarray  # int32
    rows: np.ndarray  # int64

    @classmethod
    def of_chains(cls, chains: Sequence[Sequence[int]], first_rows: Sequence[int],
                  stop_ids: frozenset) -> tuple["Walks", list[int]]:
        """Draft chains whose root (chains[i][0]) the matcher has taken: row first_rows[i] + d after
        the chain's tokens 1..d. A matcher that took a stop token has ended and fills nothing more:
        a chain's walk ends at its first stop token, and the rows after that token are returned
        for the caller to zero (no token follows a stop, so the tokens drafted past it are pruned;
        the rows below them are left alone, as the pruning never reads them).
        (Once a speculative step on the n-gram path: few numpy calls, ~9 us for one chain here.)"""
        n = len(chains)
        lengths = np.fromiter((len(c) for c in chains), np.int64, n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate([np.asarray(c, np.int32) for c in chains]) if n else np.zeros(0, np.int32)
        tokens[offsets[:-1]] = NO_TOKEN  # the root: taken already
        rows = np.repeat(np.asarray(first_rows, np.int64) - offsets[:-1], lengths)
        rows += np.arange(len(rows))
        ended = []
        if stop_ids and len(tokens):
            stops = np.flatnonzero(np.isin(tokens, np.fromiter(stop_ids, np.int32, len(stop_ids))))
            chain_of = np.searchsorted(offsets, stops, side="right") - 1
            last = -1
            for k, i in zip(stops.tolist(), chain_of.tolist()):  # a few stops a step at most
                if i == last:
                    continue  # past this chain's first stop
                last, end = i, int(offsets[i + 1])
                ended.append(int(rows[k]))
                rows[k:end] = -1
                tokens[k + 1:end] = NO_TOKEN
        return cls(offsets, np.zeros(len(tokens), np.int32), tokens, rows), ended


class WalkSteps:
    """Walks built step by step (`add_paths`, `end_walk`), then as arrays (`walks`)."""

    def __init__(self):
        self.offsets, self.back, self.tokens, self.rows = [0], [], [], []

    def add_paths(self, paths: Sequence[Sequence[int]], rows: Sequence[int], order: Sequence[int],
                  refused=None) -> None:
        """Steps filling rows[j] after paths[j], for j in `order` (sorted paths: a depth-first
        order). `refused(token)`: True for a token to pass as REFUSED."""
        back, tokens, out_rows = self.back, self.tokens, self.rows
        on: Sequence[int] = ()
        for j in order:
            path = paths[j]
            keep = _stem(on, path)
            drop = len(on) - keep
            if keep == len(path):
                back.append(drop)
                tokens.append(NO_TOKEN)
            else:
                for t in path[keep:]:
                    back.append(drop)
                    tokens.append(REFUSED if refused is not None and refused(t) else t)
                    out_rows.append(-1)
                    drop = 0
                out_rows.pop()
            out_rows.append(rows[j])
            on = path

    def end_walk(self) -> None:
        self.offsets.append(len(self.tokens))

    def walks(self) -> Walks:
        return Walks(np.array(self.offsets, np.int64), np.array(self.back, np.int32),
                     np.array(self.tokens, np.int32), np.array(self.rows, np.int64))


def _stem(on: Sequence[int], path: Sequence[int]) -> int:
    """How many leading tokens the path walked last (`on`) and the next one share."""
    keep, top = 0, min(len(on), len(path))
    while keep < top and on[keep] == path[keep]:
        keep += 1
    return keep


def sorted_paths(paths: Sequence[Sequence[int]]) -> list[int]:
    return sorted(range(len(paths)), key=paths.__getitem__)


def split_paths(order: list[int], parts: int) -> list[list[int]]:
    """`order` (sorted paths' indices) cut into up to `parts` runs of near-equal length
    (neighbours in sorted order share the longest stems)."""
    n = len(order)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [order]
    cuts = [(k * n + parts // 2) // parts for k in range(parts + 1)]
    return [order[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def walk_paths_here(matcher, paths: Sequence[Sequence[int]], rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """The rows of `paths` as the pool's walks fill them (sorted, a shared stem accepted once; a
    refused token's row and its subtree's zeroed; row -1: none), walked on this thread through the
    matcher's Python methods without building steps. For one walk on one thread this is the cheaper
    form."""
    on: list = []  # the tokens the matcher has taken beyond where it started
    for j in sorted_paths(paths):
        path, row = paths[j], rows[j]
        keep = _stem(on, path)
        if keep < len(on):
            matcher.rollback(len(on) - keep)
            del on[keep:]
        for t in path[keep:]:
            if matcher.never_accepts(t) or not matcher.accept_token(t):
                break
            on.append(t)
        if row < 0:
            continue
        if len(on) == len(path):
            matcher.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = 0
    matcher.rollback(len(on))
