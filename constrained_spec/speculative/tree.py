"""Draft trees in xgrammar's layout, batched, with the derived structure verification needs.

A request's draft tree is a flat list of nodes (design notes):
  * ``tokens[i]``: the token of node i; node 0 is the last verified token (its KV is computed in the
    verify pass together with the drafts);
  * ``next_token[i]``: the first child of i, or -1;
  * ``next_sibling[i]``: the next sibling of i, or -1.
Children are tried in sibling order (best first). A batch pads every tree to ``N`` nodes (padding:
token 0, links -1) and ``num_nodes[b]`` says how many are real; nothing links to a padded node.

Two representations:
  * :class:`DraftTrees`: torch tensors (device-side verification, e.g. rejection sampling);
  * :class:`HostTrees`: numpy arrays on the host, what the speculative step builds each step: the
    verify inputs (RoPE depth, tree mask) and greedy acceptance come from it without a kernel launch.
    Pruning there never moves a node: a pruned node stays in place, unlinked, with a self-only mask
    row, so the [B, N] layout the device sees stays as it was.

Derived (vectorized over the batch; cheap for N <= 64; all on the trees' device):
  * ``parents [B, N]`` (-1 for the root and padding),
  * ``depth [B, N]`` = position offset from node 0 (0 for padding),
  * ``mask [B, N, N]`` bool, ``mask[b, i, j]`` = node j is i or an ancestor of i: exactly the
    attention backend's ``tree_mask`` convention. Padded rows see only themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["DraftTrees", "HostTrees", "allowed_from_bitmask", "host_ancestors", "host_parents"]


def _doubling_steps(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))))


@dataclass
class DraftTrees:
    tokens: torch.Tensor  # [B, N] int64
    next_token: torch.Tensor  # [B, N] int64
    next_sibling: torch.Tensor  # [B, N] int64
    num_nodes: torch.Tensor  # [B] int64
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, tokens, next_token, next_sibling, num_nodes=None,
                    device: torch.device | str | None = None) -> "DraftTrees":
        """From [B, N] numpy arrays / tensors (any int dtype), e.g. ``NgramTrie.propose_batch``."""
        def t(x):
            x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
            return x.to(device=device, dtype=torch.int64)
        tok, nxt, sib = t(tokens), t(next_token), t(next_sibling)
        if tok.dim() == 1:
            tok, nxt, sib = tok[None], nxt[None], sib[None]
        if num_nodes is None:
            num_nodes = torch.full((tok.shape[0],), tok.shape[1], dtype=torch.int64)
        return cls(tok, nxt, sib, t(num_nodes).reshape(-1))

    @classmethod
    def from_lists(cls, trees: Sequence[tuple], width: int | None = None,
                   device: torch.device | str | None = None) -> "DraftTrees":
        """From per-request ``(tokens, next_token, next_sibling)`` sequences; pads to ``width``."""
        counts = [len(t[0]) for t in trees]
        n = max(width or 0, max(counts, default=1), 1)
        b = len(trees)
        tok = np.zeros((b, n), np.int64)
        nxt = np.full((b, n), -1, np.int64)
        sib = np.full((b, n), -1, np.int64)
        for i, (t, x, s) in enumerate(trees):
            tok[i, :len(t)] = t
            nxt[i, :len(x)] = x
            sib[i, :len(s)] = s
        return cls.from_arrays(tok, nxt, sib, np.asarray(counts, np.int64), device=device)

    @classmethod
    def chains(cls, root_tokens, drafts, device=None) -> "DraftTrees":
        """Chains: node 0 = root token, then the draft tokens in order. drafts: [B, K] (or lists)."""
        trees = []
        for r, d in zip(root_tokens, drafts):
            d = list(d)
            n = len(d) + 1
            trees.append(([int(r)] + [int(v) for v in d], list(range(1, n)) + [-1], [-1] * n))
        return cls.from_lists(trees, device=device)

    # ------------------------------------------------------------------ basics
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device, non_blocking: bool = False) -> "DraftTrees":
        return DraftTrees(*(x.to(device, non_blocking=non_blocking) for x in
                            (self.tokens, self.next_token, self.next_sibling, self.num_nodes)))

    # ------------------------------------------------------------------ derived structure
    @property
    def valid(self) -> torch.Tensor:
        """[B, N] bool: node is real (not padding)."""
        if "valid" not in self._cache:
            idx = torch.arange(self.width, device=self.device)
            self._cache["valid"] = idx[None, :] < self.num_nodes[:, None]
        return self._cache["valid"]

    @property
    def parents(self) -> torch.Tensor:
        """[B, N] int64: parent node index, -1 for the root and padding."""
        if "parents" not in self._cache:
            self._cache["parents"] = _parents(self.next_token, self.next_sibling, self.valid)
        return self._cache["parents"]

    @property
    def mask(self) -> torch.Tensor:
        """[B, N, N] bool: mask[b, i, j] = j is i or an ancestor of i."""
        if "mask" not in self._cache:
            self._cache["mask"] = _ancestor_mask(self.parents)
        return self._cache["mask"]

    @property
    def depth(self) -> torch.Tensor:
        """[B, N] int64: depth of each node (root 0) = position offset from node 0."""
        if "depth" not in self._cache:
            self._cache["depth"] = self.mask.sum(-1) - 1
        return self._cache["depth"]

    positions = depth  # alias: position offsets relative to node 0

    # ------------------------------------------------------------------ pruning
    def prune(self, allowed: torch.Tensor) -> tuple["DraftTrees", torch.Tensor]:
        """Drop every node whose ``allowed`` is False together with its subtree and re-pack.

        allowed: [B, N] bool (node 0 is always kept). Kept nodes keep their relative order, so the
        packed layout still has parents before children and siblings in order. Returns
        ``(pruned, old_index)``, old_index [B, N] int64 = the old node index of each new node
        (-1 for padding): gather logits, bitmask rows or draft probabilities with it.
        """
        b, n = self.tokens.shape
        dev = self.device
        idx = torch.arange(n, device=dev)
        allowed = allowed.to(dev, torch.bool) | (idx == 0)[None, :]
        allowed = allowed & self.valid
        keep = ~(self.mask & ~allowed[:, None, :]).any(-1) & self.valid  # all ancestors allowed
        new_index = torch.where(keep, keep.cumsum(-1) - 1, torch.full_like(idx, -1)[None, :])

        # g[j] = first kept node on the sibling chain starting at j (index n = none).
        sib_ext = torch.cat([torch.where(self.next_sibling >= 0, self.next_sibling, n),
                             torch.full((b, 1), n, device=dev, dtype=torch.int64)], 1)
        keep_ext = torch.cat([keep, torch.ones((b, 1), device=dev, dtype=torch.bool)], 1)
        idx_ext = torch.arange(n + 1, device=dev).expand(b, n + 1)
        g = torch.where(keep_ext, idx_ext, sib_ext)
        for _ in range(_doubling_steps(n + 1)):
            g = g.gather(1, g)
        remap = torch.cat([new_index, torch.full((b, 1), -1, device=dev, dtype=torch.int64)], 1)

        def relink(links):
            first = g.gather(1, torch.where(links >= 0, links, n))
            return remap.gather(1, first)

        nt, ns = relink(self.next_token), relink(self.next_sibling)
        old_ext = torch.full((b, n + 1), -1, device=dev, dtype=torch.int64)
        old_ext.scatter_(1, torch.where(keep, new_index, n), idx.expand(b, n).contiguous())
        old_index = old_ext[:, :n]
        live = old_index >= 0
        src = old_index.clamp(min=0)
        pruned = DraftTrees(
            torch.where(live, self.tokens.gather(1, src), 0),
            torch.where(live, nt.gather(1, src), -1),
            torch.where(live, ns.gather(1, src), -1),
            keep.sum(-1),
        )
        return pruned, old_index


def allowed_from_bitmask(trees: DraftTrees, bitmask: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: node j's token is allowed by the bitmask row of its parent.

    bitmask: [B, N, ceil(V/32)] int32, row i = the grammar's allowed next tokens after node i (as
    filled by ``GrammarMatcher.traverse_draft_tree``). The root is always allowed.
    """
    bitmask = bitmask.to(trees.device)
    parent = trees.parents.clamp(min=0)
    tok = trees.tokens
    rows = bitmask.gather(1, parent[:, :, None].expand(-1, -1, bitmask.shape[2]))  # [B, N, W]
    words = rows.gather(2, (tok >> 5)[:, :, None]).squeeze(2)
    bits = (words >> (tok & 31).to(words.dtype)) & 1
    return ((bits != 0) | (trees.parents < 0)) & trees.valid


# ---------------------------------------------------------------------- internals
def _parents(next_token: torch.Tensor, next_sibling: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    b, n = next_token.shape
    dev = next_token.device
    idx = torch.arange(n, device=dev).expand(b, n).contiguous()
    nt = torch.where(valid & (next_token >= 0), next_token, n)
    ns = torch.where(valid & (next_sibling >= 0), next_sibling, n)
    first_parent = torch.full((b, n + 1), -1, device=dev, dtype=torch.int64)
    first_parent.scatter_(1, nt, idx)  # column n collects the "no child" writes
    prev = torch.full((b, n + 1), -1, device=dev, dtype=torch.int64)
    prev.scatter_(1, ns, idx)
    first_parent, prev = first_parent[:, :n], prev[:, :n]
    # head[j] = the first sibling of j's chain (pointer doubling along prev links).
    head = torch.where(prev >= 0, prev, idx)
    for _ in range(_doubling_steps(n)):
        head = head.gather(1, head)
    parents = first_parent.gather(1, head)
    return torch.where(valid, parents, -1)


def _ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    b, n = parents.shape
    dev = parents.device
    eye = torch.eye(n, device=dev, dtype=torch.bool).expand(b, n, n)
    step = torch.zeros((b, n, n + 1), device=dev, dtype=torch.bool)
    step.scatter_(2, torch.where(parents >= 0, parents, n)[:, :, None], True)
    m = eye | step[:, :, :n]
    # transitive closure by repeated squaring: after k rounds, paths of length < 2^k are covered
    mf = m.to(torch.float32)
    for _ in range(_doubling_steps(n)):
        mf = (mf + torch.bmm(mf, mf)).clamp_(max=1.0)
    return mf > 0


# ---------------------------------------------------------------------- host (numpy) trees
@dataclass
class HostTrees:
    """A batch of draft trees as numpy arrays on the host, with the structure verification needs.

    Built once per speculative step from the drafter's arrays. ``live`` marks the nodes that can be
    accepted: the root and every node reachable from it through the links. Padding and pruned nodes
    keep their index (the verify forward has a static [B, N] shape) with parent -1, depth 0 and a
    self-only mask row; a pruned node's token stays as it was (a legal model input, never accepted).
    """
    tokens: np.ndarray  # [B, N] int64
    next_token: np.ndarray  # [B, N] int64, -1 = none
    next_sibling: np.ndarray  # [B, N] int64, -1 = none
    num_nodes: np.ndarray  # [B] int64: nodes [0, num_nodes) are the drafter's, the rest padding
    parents: np.ndarray  # [B, N] int64, -1 for the root, padding and unlinked nodes
    depth: np.ndarray  # [B, N] int64: RoPE offset from node 0
    mask: np.ndarray  # [B, N, N] bool: mask[b, i, j] = j is i or an ancestor of i
    live: np.ndarray  # [B, N] bool

    @classmethod
    def build(cls, tokens, next_token, next_sibling, num_nodes=None) -> "HostTrees":
        """From [B, N] integer arrays in xgrammar's layout (see the module docstring)."""
        tok = np.asarray(tokens, dtype=np.int64)
        nxt = np.asarray(next_token, dtype=np.int64)
        sib = np.asarray(next_sibling, dtype=np.int64)
        if tok.ndim == 1:
            tok, nxt, sib = tok[None], nxt[None], sib[None]
        count = (np.full(tok.shape[0], tok.shape[1], np.int64) if num_nodes is None
                 else np.asarray(num_nodes, dtype=np.int64).reshape(-1))
        chains = _chain_structure(nxt, sib, count)
        if chains is not None:
            return cls(tok, nxt, sib, count, *chains)
        parents = host_parents(nxt, sib, count)
        mask, depth = host_ancestors(parents)
        live = mask[:, :, 0] & (count > 0)[:, None]  # reachable from the root
        return cls(tok, nxt, sib, count, parents, depth, mask, live)

    @classmethod
    def from_draft_trees(cls, trees: DraftTrees) -> "HostTrees":
        return cls.build(*(t.cpu().numpy() for t in (trees.tokens, trees.next_token, trees.next_sibling,
                                                      trees.num_nodes)))

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    def node_paths(self, b: int, skip: np.ndarray | None = None) -> tuple[list[list[int]], list[int]]:
        """Tree b's nodes reachable from the root but those in `skip` ([N] bool), as (the tokens from
        the root to each node, root excluded; the node's index), parents before children."""
        tokens, parents = self.tokens[b].tolist(), self.parents[b].tolist()
        live = np.flatnonzero(self.live[b]).tolist()
        paths: dict[int, list[int]] = {0: []}
        for i in live[1:]:
            paths[i] = paths[parents[i]] + [tokens[i]]
        if skip is not None:
            live = [i for i in live if not skip[i]]
        return [paths[i] for i in live], live

    def is_chain(self) -> np.ndarray:
        """[B] bool: tree b is a chain in layout order (node i's only child is i + 1)."""
        return _chain_rows(self.next_token, self.next_sibling, self.num_nodes)

    def allowed_by(self, bitmask: np.ndarray) -> np.ndarray:
        """[B, N] bool: node j's token is allowed by the bitmask row of its parent (the root always is).

        bitmask: [B, N, ceil(V/32)] int32, row i = the tokens legal after node i (as filled by
        ``MaskFiller.fill_paths``). Rows of nodes the fill did not reach may hold anything: a node
        is only kept when its whole path is allowed, so such rows are never trusted."""
        b, n = self.shape
        parent = np.maximum(self.parents, 0)
        words = bitmask[np.arange(b)[:, None], parent, self.tokens >> 5]  # int32, sign-extended below
        bits = (words.astype(np.int64) >> (self.tokens & 31)) & 1
        allowed = (bits != 0) & (self.parents >= 0)
        allowed[:, 0] = True
        return allowed

    def pruned(self, allowed: np.ndarray) -> "HostTrees":
        """Unlinks every node whose ``allowed`` is False together with its subtree; no node moves.

        Kept nodes keep their order (parents before children, siblings in order), their depth and
        their mask rows; the links skip the pruned nodes."""
        b, n = self.shape
        allowed = np.asarray(allowed, dtype=bool).copy()
        allowed[:, 0] = True
        if _is_chain(self.next_token, self.next_sibling, self.num_nodes):  # closed form, as in build
            keep = np.logical_and.accumulate(allowed, axis=1) & self.live
            next_kept = np.concatenate([keep[:, 1:], np.zeros((b, 1), bool)], 1)
            next_token, next_sibling = np.where(keep & next_kept, np.arange(n) + 1, -1), self.next_sibling
        else:
            keep = ~(self.mask & ~allowed[:, None, :]).any(-1) & self.live  # every node on the path allowed
            first_kept = _first_kept_sibling(self.next_sibling, keep)

            def relink(links):
                target = np.take_along_axis(first_kept, np.where(links >= 0, links, n), 1)
                return np.where(keep & (target < n), target, -1)
            next_token, next_sibling = relink(self.next_token), relink(self.next_sibling)
        eye = np.eye(n, dtype=bool)[None]
        return HostTrees(self.tokens, next_token, next_sibling, self.num_nodes,
                         np.where(keep, self.parents, -1), np.where(keep, self.depth, 0),
                         (self.mask & keep[:, :, None]) | eye, keep)

    def to_draft_trees(self, device: torch.device | str | None = None) -> DraftTrees:
        """The same trees as torch tensors on ``device`` (one host-to-device copy)."""
        b, n = self.shape
        packed = np.concatenate([self.tokens.reshape(-1), self.next_token.reshape(-1),
                                 self.next_sibling.reshape(-1), self.num_nodes])
        t = torch.from_numpy(packed).to(device)
        tok, nxt, sib, count = torch.split(t, [b * n, b * n, b * n, b])
        return DraftTrees(tok.view(b, n), nxt.view(b, n), sib.view(b, n), count)


def _chain_structure(next_token: np.ndarray, next_sibling: np.ndarray, num_nodes: np.ndarray):
    """(parents, depth, mask, live) when every tree is a chain (node i's only child is i + 1 up to
    num_nodes), else None. Chains are what the engine drafts by default (grammar-guided and
    single-branch trie drafts); their structure has a closed form, several times cheaper than the
    general closure below on the speculative step's serial host path."""
    if not _is_chain(next_token, next_sibling, num_nodes):
        return None
    b, n = next_token.shape
    idx = np.arange(n)
    count = np.minimum(num_nodes, n)[:, None]
    live = (idx < count) & (count > 0)
    parents = np.where(live & (idx > 0), idx - 1, -1)
    depth = np.where(live, idx, 0)
    mask = (np.tri(n, dtype=bool) & live[:, None, :] & live[:, :, None]) | np.eye(n, dtype=bool)
    return parents, depth, mask, live


def _chain_rows(next_token: np.ndarray, next_sibling: np.ndarray, num_nodes: np.ndarray) -> np.ndarray:
    """[B] bool: tree b is a chain in layout order (node i's only child is i + 1, up to num_nodes)."""
    idx = np.arange(next_token.shape[1])
    chain_next = np.where(idx + 1 < np.minimum(num_nodes, len(idx))[:, None], idx + 1, -1)
    return (next_sibling < 0).all(1) & (next_token == chain_next).all(1)


def _is_chain(next_token: np.ndarray, next_sibling: np.ndarray, num_nodes: np.ndarray) -> bool:
    """Every tree is a chain in layout order."""
    return bool(_chain_rows(next_token, next_sibling, num_nodes).all())


def host_parents(next_token: np.ndarray, next_sibling: np.ndarray, num_nodes: np.ndarray) -> np.ndarray:
    """[B, N] parent of each node from first-child / next-sibling links; -1 for the root, padding
    and nodes no link reaches. Vectorized over the batch: the first sibling of each chain is found
    by pointer doubling along reversed sibling links, and its parent is the node naming it first child."""
    b, n = next_token.shape
    idx = np.arange(n)
    rows = np.arange(b)[:, None]
    valid = idx[None, :] < num_nodes[:, None]
    first_parent = np.full((b, n + 1), -1, np.int64)  # column n collects the "no link" writes
    first_parent[rows, np.where(valid & (next_token >= 0), next_token, n)] = idx
    prev = np.full((b, n + 1), -1, np.int64)
    prev[rows, np.where(valid & (next_sibling >= 0), next_sibling, n)] = idx
    head = np.where(prev[:, :n] >= 0, prev[:, :n], idx)
    for _ in range(_doubling_steps(n)):
        head = np.take_along_axis(head, head, 1)
    parents = np.take_along_axis(first_parent[:, :n], head, 1)
    return np.where(valid, parents, -1)


def host_ancestors(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mask [B, N, N] bool, depth [B, N] int64) from parents: mask[b, i, j] = j is i or an ancestor
    of i. Transitive closure of the parent relation by repeated squaring (small float32 matmuls)."""
    b, n = parents.shape
    step = np.zeros((b, n, n + 1), np.float32)
    step[np.arange(b)[:, None], np.arange(n)[None, :], np.where(parents >= 0, parents, n)] = 1.0
    m = step[:, :, :n] + np.eye(n, dtype=np.float32)
    for _ in range(_doubling_steps(n)):  # after k rounds, paths of length < 2^k are covered
        m = np.minimum(m @ m, 1.0)
    mask = m > 0
    return mask, mask.sum(-1, dtype=np.int64) - 1


def _first_kept_sibling(next_sibling: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[B, N+1]: for each node j, the first kept node on the sibling chain starting at j (n = none;
    column n is the 'none' sentinel itself)."""
    b, n = next_sibling.shape
    sib = np.concatenate([np.where(next_sibling >= 0, next_sibling, n), np.full((b, 1), n)], 1)
    kept = np.concatenate([keep, np.ones((b, 1), bool)], 1)
    g = np.where(kept, np.arange(n + 1), sib)
    for _ in range(_doubling_steps(n + 1)):
        g = np.take_along_axis(g, g, 1)
    return g
