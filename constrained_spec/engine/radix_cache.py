"""A radix tree over token ids whose nodes own KV slots of the pool (page size 1), for prefix caching.

Every edge holds a run of tokens (`key`) and the slots holding their K/V (`slots`, one per token),
so the path from the root to a node spells a token prefix and lists the slots of its context in
order. A request whose prompt starts with a cached prefix takes those slots into its table row and
prefills only the rest (the extend path over a cached prefix, as a later prompt chunk does).

Ownership: a slot is either free in the pool, or owned by exactly one request (its own tokens
past its cached prefix), or owned by exactly one tree node. Requests using a node hold a reference
on it and on all its ancestors (`lock`), and referenced nodes are never evicted. Unreferenced leaves
go least recently used first when the pool runs short (`evict`); freeing a leaf may make its parent
a leaf in turn. Sizes are kept as counters so that the scheduler's "how many slots can I have"
(free + evictable) costs nothing. The eviction candidates live in a heap kept as the tree changes
(entries go stale rather than being removed, and are skipped when popped): a full pool evicts at
every few admissions, and a walk over thousands of leaves each time cost a loaded engine ~30% of
its thread.

Only verified tokens are ever inserted (the speculative step frees rejected draft slots before a
request's context can be cached), and grammar state is not cached at all: a matcher starts fresh at
a request's first generated token whatever prefix its prompt shares.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

import numpy as np


_NO_SLOTS = np.empty(0, np.int64)
_NO_SLOTS.flags.writeable = False  # shared by every empty match


class Node:
    __slots__ = ("key", "key_bytes", "slots", "children", "parent", "refs", "last_access", "depth", "head")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: "Node | None", key_bytes: bytes | None = None):
        self.key = key  # int64 token ids of the edge into this node
        # the same, for a whole-edge test without numpy (`_edge_match`)
        self.key_bytes = key.tobytes() if key_bytes is None else key_bytes
        self.slots = slots  # int64 KV slots of those tokens
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.parent = parent
        self.refs = 0  # requests using this node's slots (directly or through a descendant)
        self.last_access = 0
        self.depth = len(key) if parent is None else parent.depth + len(key)  # tokens its path spells
        self.head = None  # its path's first `head_len` tokens as bytes, if its edge holds the last of them

    def __len__(self) -> int:
        return len(self.key)


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    a, b = a[:n], b[:n]
    if a.tobytes() == b.tobytes():
        return n
    return int(np.argmin(a == b))


def _edge_match(child: Node, key: np.ndarray, key_bytes: bytes, pos: int) -> int:
    """How many tokens of `child`'s edge match `key` from `pos`. Most steps of a walk match a whole
    edge, tested on bytes in ~0.1 us (numpy's compare costs ~2 us): a finished request's insert
    walks one node per answer length cached before it, since identical greedy answers of varied
    lengths split their path token by token."""
    edge = child.key_bytes
    if key_bytes.startswith(edge, 8 * pos):
        return len(edge) >> 3
    return _common_length(child.key, key[pos:])


class RadixCache:
    """The tree. `free_slots(slots)` gives evicted slots back to the pool. With `head_len`, the tree
    keeps the set of its paths' first `head_len` tokens (`_heads`), so that a lookup that would
    count anything shorter as a miss answers "miss" without walking when the tokens' first
    `head_len` are not a cached path's: where prompts share nothing, each admission's walk cost ~9
    us of the engine thread, for nothing."""

    def __init__(self, free_slots: Callable[[np.ndarray], None], head_len: int = 0):
        self._free_slots = free_slots
        self.head_len = head_len
        self._heads: set[bytes] = set()  # of the nodes whose edge holds their path's token head_len - 1
        self._clock = itertools.count(1)  # LRU order: a counter, not wall time (ties are impossible)
        self.root = Node(np.empty(0, np.int64), np.empty(0, np.int64), None)
        self.root.refs = 1  # never evicted
        self.size = 0  # tokens (= slots) held by the tree
        self.evictable_size = 0  # of those, in nodes no request references
        self.evicted_tokens = 0  # over the cache's life
        self._nodes = 0  # nodes besides the root
        # (last_access, tiebreak, node) of nodes that were unreferenced leaves when pushed; an entry
        # is live while the node still is one, attached, with that last_access (`_is_candidate`)
        self._candidates: list[tuple[int, int, Node]] = []
        self._tiebreak = itertools.count()

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, tokens, min_length: int = 0) -> tuple[np.ndarray, Node]:
        """The slots of the longest cached prefix of `tokens`, and the deepest node on it (the one
        to lock). A match may end inside an edge: that edge is split there, so the returned node
        covers exactly the matched prefix. A match shorter than `min_length` is none (no slots, the
        root), and changes nothing: no split, no LRU touch."""
        key = np.asarray(tokens, dtype=np.int64)
        if self._no_head(key, min_length):
            return _NO_SLOTS, self.root
        key_bytes = key.tobytes()
        node, pos, path, cut = self.root, 0, [], 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            n = _edge_match(child, key, key_bytes, pos)
            path.append(child)
            node, pos = child, pos + n
            if n < len(child.key):
                cut = n
                break
        if pos < min_length:
            return _NO_SLOTS, self.root
        if cut:
            node = path[-1] = self._split(node, cut)
        stamp = next(self._clock)
        for child in path:
            child.last_access = stamp
        self._offer(node)
        if len(path) == 1:  # the node's own array: callers copy what they keep (`np.concatenate` would)
            return node.slots, node
        slots = np.concatenate([child.slots for child in path]) if path else _NO_SLOTS
        return slots, node

    def match_length(self, tokens, min_length: int = 0) -> int:
        """How many leading tokens of `tokens` are cached (0 if fewer than `min_length`), changing
        nothing (no split, no LRU touch): for ordering the waiting queue."""
        key = np.asarray(tokens, dtype=np.int64)
        if self._no_head(key, min_length):
            return 0
        key_bytes = key.tobytes()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            n = _edge_match(child, key, key_bytes, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos if pos >= min_length else 0

    def _no_head(self, key: np.ndarray, min_length: int) -> bool:
        """Whether a match of `key` is certainly shorter than `min_length` because no cached path
        starts with its first `head_len` tokens (`head_len` 0: unknown)."""
        h = self.head_len
        return 0 < h <= min_length and key[:h].tobytes() not in self._heads

    def _path_bytes(self, node: Node) -> bytes:
        """The tokens `node`'s path spells, as bytes (walked up: for nodes near the root)."""
        parts = []
        while node is not self.root:
            parts.append(node.key_bytes)
            node = node.parent
        return b"".join(reversed(parts))

    def insert(self, tokens, slots: np.ndarray, below: Node | None = None) -> int:
        """Caches `slots` as the K/V of `tokens`. Returns how many leading tokens were cached
        already: the caller's slots for those positions are duplicates (the tree keeps its own) and
        are the caller's to free; the slots past them now belong to the tree. `below`: a node whose
        path `tokens` continue (the root's when None), where the walk starts; it must be locked (so
        it is still in the tree: a split keeps it the deeper part). A request passes only what
        follows its matched node: its cached prefix is neither walked nor copied again.
        The tree keeps views of `tokens` and `slots` (no copy: the engine's are made for the call
        and never written again), so a caller must not change them afterwards.
        Tokens that end inside an edge add nothing and leave the edge whole: cutting it there, as
        identical greedy answers of varied lengths would at every length, splits a path into
        one-token nodes that every later walk goes through."""
        return self._insert(tokens, slots, below)[0]

    def insert_path(self, tokens, slots: np.ndarray, below: Node | None = None) -> tuple[int, Node]:
        """`insert`, and the node whose path spells `below`'s and then all of `tokens` (to lock,
        sparing a `match`)."""
        pos, node, inside = self._insert(tokens, slots, below)
        if inside:  # the tokens end inside this edge: cut it, so that one node spells exactly them
            node = self._split(node, inside)
        return pos, node

    def _insert(self, tokens, slots: np.ndarray, below) -> tuple[int, Node, int]:
        """The walk of `insert`: (tokens cached already, the last node reached, and where in that
        node's edge the tokens end when they end inside it, else 0)."""
        key = np.asarray(tokens, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if len(key) != len(slots):
            raise ValueError(f"{len(key)} tokens but {len(slots)} slots")
        key_bytes = key.tobytes()
        node, pos = below if below is not None else self.root, 0
        stamp = next(self._clock)
        inside = 0
        while pos < len(key):
            first = int(key[pos])
            child = node.children.get(first)
            if child is None:
                leaf = Node(key[pos:], slots[pos:], node, key_bytes[8 * pos:] if pos else key_bytes)
                leaf.last_access = stamp
                if node.depth < self.head_len <= leaf.depth:
                    head = leaf.key_bytes[:8 * (self.head_len - node.depth)]
                    leaf.head = self._path_bytes(node) + head if node.depth else head
                    self._heads.add(leaf.head)
                node.children[first] = leaf
                self.size += len(leaf)
                self.evictable_size += len(leaf)
                self._nodes += 1
                node = leaf
                break
            n = _edge_match(child, key, key_bytes, pos)
            if n < len(child.key):
                if pos + n == len(key):
                    inside = n
                else:  # the tokens go on past where they leave this edge: a new leaf at the cut
                    child = self._split(child, n)
            child.last_access = stamp
            node, pos = child, pos + n
        self._offer(node)
        return pos, node, inside

    # -- references ------------------------------------------------------------------------------
    def lock(self, node: Node) -> int:
        """A request now uses the slots on the path to `node`. Returns how many slots stopped
        being evictable."""
        moved = 0
        while node is not self.root:
            if node.refs == 0:
                moved += len(node)
            node.refs += 1
            node = node.parent
        self.evictable_size -= moved
        return moved

    def unlock(self, node: Node) -> int:
        """Drops a reference taken by `lock`. Returns how many slots became evictable."""
        moved = 0
        while node is not self.root:
            if node.refs <= 0:
                raise RuntimeError("prefix cache: unlock of an unreferenced node")
            node.refs -= 1
            if node.refs == 0:
                moved += len(node)
                self._offer(node)
            node = node.parent
        self.evictable_size += moved
        return moved

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` slots (fewer if not that many are evictable) from
        unreferenced leaves, least recently used first. Returns how many were freed."""
        if num_tokens <= 0:
            return 0
        freed = 0
        while freed < num_tokens and self._candidates:  # not aliased: `_offer` may rebuild it
            stamp, _, leaf = heapq.heappop(self._candidates)
            if not self._is_candidate(leaf, stamp):
                continue
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            leaf.parent = None  # detached: its other heap entries are stale
            if leaf.head is not None:
                self._heads.discard(leaf.head)
            self._nodes -= 1
            self._free_slots(leaf.slots)
            freed += len(leaf)
            self._offer(parent)
        self.size -= freed
        self.evictable_size -= freed
        self.evicted_tokens += freed
        return freed

    def _offer(self, node: Node) -> None:
        """Makes `node` an eviction candidate if it is an unreferenced leaf (called wherever a node
        may have become one, or had its last_access changed while one)."""
        if node.refs == 0 and not node.children and node is not self.root:
            heapq.heappush(self._candidates, (node.last_access, next(self._tiebreak), node))
            if len(self._candidates) > 2 * self._nodes + 64:
                self._compact()

    def _is_candidate(self, node: Node, stamp: int) -> bool:
        return (node.parent is not None and node.refs == 0 and not node.children
                and node.last_access == stamp)

    def _compact(self) -> None:
        """Drops stale entries (the heap holds at most ~2 per node; rebuilding is linear and
        happens once per as many pushes)."""
        live = {id(n): e for e in self._candidates if self._is_candidate(n := e[2], e[0])}
        self._candidates = list(live.values())
        heapq.heapify(self._candidates)

    # -- structure -------------------------------------------------------------------------------
    def _split(self, child: Node, n: int) -> Node:
        """Cuts `child`'s edge after `n` tokens; returns the new node holding the first part. The
        new node carries the child's references (every request locking the child uses it too)."""
        head = Node(child.key[:n], child.slots[:n], child.parent)
        self._nodes += 1
        head.refs = child.refs
        head.last_access = child.last_access
        if child.head is not None and head.depth >= self.head_len:  # the head's last token is in the first part
            head.head, child.head = child.head, None
        head.children[int(child.key[n])] = child
        child.parent.children[int(child.key[0])] = head
        child.parent = head
        child.key = child.key[n:]
        child.key_bytes = child.key_bytes[8 * n:]
        child.slots = child.slots[n:]
        return head

    def all_slots(self) -> np.ndarray:
        """Every slot the tree owns (tests: slot accounting)."""
        parts, stack = [], [self.root]
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
        return np.concatenate(parts)

    def heads(self) -> set[bytes]:
        """The set `match` tests (tests: against `all_heads`)."""
        return set(self._heads)

    def all_heads(self) -> set[bytes]:
        """Every cached path's first `head_len` tokens, by a walk (tests)."""
        found, stack = set(), [(self.root, b"")]
        while stack:
            node, path = stack.pop()
            path += node.key_bytes
            if len(path) >= 8 * self.head_len > 0:
                found.add(path[:8 * self.head_len])
                continue
            stack.extend((child, path) for child in node.children.values())
        return found

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1
