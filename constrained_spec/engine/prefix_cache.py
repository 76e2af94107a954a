"""Prefix caching for the engine: the radix tree (`radix_cache.py`) tied to the slot pool, the
request→slots table and the requests' lives.

A request's table row is its cached prefix's slots (owned by the tree, which the request holds a
reference on: `req.cache_node`, `req.cache_len`) followed by its own slots. Three moments:
- **admission** (`admit`, by the scheduler): the longest cached prefix of the request's tokens
  (never all of them: the last token is computed, for its logits; none shorter than `min_match`)
  is locked and becomes the row's start; `num_cached` starts there, so the prefill covers only the
  rest.
- **prompt prefilled** (`cache_prompts`, at the scheduler's next step): a prompt with at least
  RUNNING_SHARE uncached tokens is filed under (its locked node, its first RUNNING_SHARE uncached
  tokens). An admission whose match ends at that node and goes on with those tokens (n > 1
  siblings, the same system prompt under load) puts the prompt into the tree first and matches
  again, so it reuses the prompt while its request still decodes. Positions another request cached meanwhile are
  duplicates: the row is pointed at the tree's slots and its own are freed. A prompt nobody
  shares goes into the tree once, with its answer, at release.
- **release** (`release`: finish, abort, retraction): the verified context (prompt and output
  tokens whose K/V were computed) goes into the tree; duplicates and slots past it go back to the
  pool; the reference is dropped. A request that failed (an engine error) caches nothing. While the
  cache misses (no first admission among the last MISS_WINDOW found a prefix), only every
  SAMPLE_EVERY-th finished request is filed; the others' slots go straight back to the pool, as
  without the cache (`release`); an admission that starts like one of those turns filing back on
  (RECENT_HEADS).
Speculative decoding needs nothing here: a verify step frees its rejected draft slots and trims the
row before anything can read the row for caching.
"""
from __future__ import annotations

import numpy as np

from ..pinned import GrowingStaging
from .radix_cache import RadixCache

# A running request's computed prompt is shared (put into the tree before its request ends) only
# with requests that go on with its next this many tokens past where both matched: one sharing
# less recomputes fewer tokens than that. Filing every prompt by its first uncached token alone
# would insert whole prompts for a shared digit (prompts numbered "1234: ..." and "1236: ...").
RUNNING_SHARE = 32
# A cached prefix shorter than this is not used unless it is half the prompt or more (a short
# prompt repeated): prompts that share only a chat template's first tokens (3-30) would each pay a
# lock on its path, a split of the edge where it ends (a node per admission) and its table entries
# written to the device (on the CPU, an upload of their own), to save a few tokens of a prefill
# that runs anyway (on the H200, a 7-token prefix made a 300-token prompt's extend attention up to
# 8% slower, by the pass over the prefix before the causal part).
MIN_MATCH = 32
# Filing while the cache misses. Where prompts share nothing (distinct system prompts), every
# finished request's insert is wasted: nothing ever matches it, and its leaf is evicted later. On
# the dev VM (`benchmarks/prefix_cache_loop.py`, the engine thread's CPU timed in place) a release
# that inserts cost ~39 us a request (the insert ~16, its answer's ids made an array ~10) and each
# eviction ~10.5 us a call, of the ~55-75 us a ~375 us step the cache added; on the H200 the served
# distinct workload ran at 0.93 of the cache-off engine's tok/s. So once no first admission among
# the last MISS_WINDOW found a cached prefix, a finished request's context is filed only if it is
# the SAMPLE_EVERY-th so passed over (or it was admitted while filing was on, or it is a retraction,
# whose re-prefill matches it); the others' slots go straight to the pool. The sample keeps the tree
# learning: a system prompt many requests share is cached within ~SAMPLE_EVERY of them (sooner while
# they overlap: the running-prompt sharing above does not depend on filing), and the first hit
# files everything again, before the next turn of a conversation can miss its previous answer.
MISS_WINDOW = 64
SAMPLE_EVERY = 8
# A conversation's next turn starts with its previous turn's context. While the cache misses, the
# first MIN_MATCH tokens of the last RECENT_HEADS unfiled contexts are remembered; an admission that
# misses but starts like one of them (a next turn, or any prompt sharing 32 tokens with an earlier
# one) turns filing back on, so the turn after it hits instead of waiting for a sampled request to
# hit first. ~1 us a release and an admission (a slice made bytes; one set lookup).
RECENT_HEADS = 4096


def _head(req) -> bytes | None:
    """The request's first MIN_MATCH tokens as bytes (RECENT_HEADS), None if it has fewer."""
    return req.ids_array(MIN_MATCH).tobytes() if req.total_len >= MIN_MATCH else None


def min_match(length: int) -> int:
    """The shortest cached prefix worth using for a context of `length` matchable tokens."""
    return min(MIN_MATCH, (length + 1) // 2)


class PrefixCache:
    def __init__(self, runner):
        self.runner = runner
        self.pool, self.table = runner.pool, runner.table
        self.tree = RadixCache(self.pool.free, head_len=MIN_MATCH)  # a miss is known without a walk
        self.pool.cache = self.tree
        self._prefilled: list = []  # requests whose prompt's last chunk was scheduled
        # computed prompts not in the tree yet, by (locked node, next RUNNING_SHARE tokens) (`cache_prompts`)
        self._uncached: dict[tuple, list] = {}
        self._writes: list[tuple[int, int, np.ndarray]] = []  # table rows to mirror on the device
        self.lookup_tokens = 0  # prompt tokens of first admissions
        self.hit_tokens = 0  # of those, found in the cache
        self._misses = 0  # first admissions since the last that found a cached prefix
        self._passed = 0  # finished requests released while the cache missed (the sample's counter)
        self.unfiled_requests = 0  # finished requests whose context was freed, not cached (`release`)
        self._unfiled_heads: dict[bytes, None] = {}  # their first MIN_MATCH tokens, oldest first (RECENT_HEADS)
        self._uploads = GrowingStaging(runner.device)
        self._ramp = np.arange(self.table.max_context, dtype=np.int64)

    # -- admission -------------------------------------------------------------------------------
    def admit(self, req) -> int:
        """Matches and locks the request's cached prefix; returns how many slots that took out of
        the evictable ones (the scheduler's free count shrinks by as much)."""
        ids = req.ids_array(req.total_len - 1)
        shortest = min_match(len(ids))
        slots, node = self.tree.match(ids, shortest)
        c = len(slots)
        if self._uncached and len(ids) - c >= RUNNING_SHARE:
            sharing = self._uncached.pop((node, ids[c:c + RUNNING_SHARE].tobytes()), None)
            if sharing:  # running requests' prompts go on where this match stops: cache them first
                for other in sharing:
                    other.uncached_key = None
                    if other.row >= 0:
                        self._cache_running(other, len(other.prompt_ids))
                slots, node = self.tree.match(ids, shortest)
        req.cache_node, req.cache_len, req.prefix_slots = node, len(slots), slots
        req.num_cached = len(slots)
        return self.tree.lock(node)

    def unadmit(self, req) -> int:
        """Undoes `admit` for a request that did not fit this step; returns the slots made
        evictable again."""
        moved = self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_len, req.prefix_slots = None, 0, None
        req.num_cached = 0
        return moved

    def admitted(self, req) -> None:
        """The request runs: count its hit (first admission only: a retracted request's second
        match is no prompt served from cache), and whether the cache is missing (MISS_WINDOW)."""
        if req.cached_tokens is None:
            req.cached_tokens = min(req.cache_len, len(req.prompt_ids))
            self.lookup_tokens += len(req.prompt_ids)
            self.hit_tokens += req.cached_tokens
            if req.cache_len or self._recurring_head(req):
                self._misses = 0
            else:
                self._misses += 1
            req.file_context = self.filing

    def _recurring_head(self, req) -> bool:
        """Whether a request the cache missed while not filing starts like a recently unfiled one."""
        return not self.filing and _head(req) in self._unfiled_heads

    @property
    def filing(self) -> bool:
        """Whether every finished request's context goes into the tree (a first admission among
        the last MISS_WINDOW found a cached prefix), not only a sample."""
        return self._misses < MISS_WINDOW

    def place_prefix(self, req) -> None:
        """Writes the admitted request's prefix slots into its new table row (host and device)."""
        slots = req.prefix_slots
        req.prefix_slots = None
        if slots is None or not len(slots):
            return
        self.table.append(req.row, slots)
        self._writes.append((req.row, 0, slots))  # to the device with the step's inputs (`take_writes`)

    def prompt_scheduled(self, req) -> None:
        """The step being planned computes the last of the request's prompt."""
        if len(req.prompt_ids) - req.cache_len >= RUNNING_SHARE:
            self._prefilled.append(req)

    # -- caching ---------------------------------------------------------------------------------
    def cache_prompts(self) -> None:
        """Files the prompts whose prefill was launched by an earlier step (on the device, in
        stream order, before anything an admission launches reads them) for `admit` to cache on
        demand. Inserting each at once was ~4 of the ~32 us the cache added to a host step where
        prompts share nothing (`benchmarks/prefix_cache_host.py`; their contexts go in again at
        release). The rows an on-demand insert
        repoints are mirrored on the device before the next launch: with the extend step's
        admissions' prefixes (`take_writes`), or by the scheduler's `write_device`."""
        if not self._prefilled:
            return
        reqs, self._prefilled = self._prefilled, []
        for req in reqs:
            if req.row >= 0 and req.num_cached >= len(req.prompt_ids) and req.uncached_key is None:
                c = req.cache_len
                req.uncached_key = key = (req.cache_node, req.ids_array(c + RUNNING_SHARE, c).tobytes())
                self._uncached.setdefault(key, []).append(req)

    def _forget_uncached(self, req) -> None:
        """Takes a filed request (`req.uncached_key` set) out of `_uncached`."""
        key, req.uncached_key = req.uncached_key, None
        rest = [r for r in self._uncached.pop(key, ()) if r is not req]
        if rest:
            self._uncached[key] = rest

    def _cache_running(self, req, n: int) -> None:
        row, start = req.row, req.cache_len
        slots = self.table.host[row, start:n].copy()
        # only the part past the locked node is walked (its path spells the first `start` tokens)
        dup, node = self.tree.insert_path(req.ids_array(n, start), slots, req.cache_node)
        if dup:  # another request cached these positions first: use its slots, free ours
            tree_slots = self.tree.match(req.ids_array(start + dup))[0][start:]
            self.pool.free(slots[:dup])
            self.table.host[row, start:start + dup] = tree_slots
            self._writes.append((row, start, tree_slots))
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_len = node, n

    def release(self, req, keep: bool) -> None:
        """Frees the request's row: its computed context into the tree (`keep`), the rest to the
        pool, its reference dropped. While the cache misses, a finished request outside the sample
        keeps nothing (MISS_WINDOW)."""
        if keep and not self.filing and not req.file_context and req.finish_reason is not None:
            self._passed += 1
            if self._passed % SAMPLE_EVERY:
                keep = False
                self.unfiled_requests += 1
                self._remember_head(req)
        if req.uncached_key is not None:
            self._forget_uncached(req)
        row = req.row
        if row < 0:  # admitted, but removed before its first step placed the prefix
            self._drop_reference(req)
            return
        if self._writes:  # entries not on the device yet (a repoint, a failed step's): the row is no longer its
            self._writes = [w for w in self._writes if w[0] != row]
        held = int(self.table.lengths[row])
        start = req.cache_len  # the locked node's path spells the first `start` tokens: the tree's slots
        own = self.table.release_row(row, start)  # the row's slots past them
        n = max(start, min(req.num_cached, req.total_len, held)) if keep else start
        if n > start:  # the computed context past the locked node
            dup = self.tree.insert(req.ids_array(n, start), own[:n - start], req.cache_node)
            if dup:
                self.pool.free(own[:dup])
        if n < held:  # past what was cached (the last token's K/V is not computed; nothing if not `keep`)
            self.pool.free(own[n - start:])
        self._drop_reference(req)

    def _remember_head(self, req) -> None:
        head, heads = _head(req), self._unfiled_heads
        if head is None:
            return
        heads[head] = None
        if len(heads) > RECENT_HEADS:
            del heads[next(iter(heads))]

    def _drop_reference(self, req) -> None:
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cache_len, req.prefix_slots = None, 0, None

    # -- figures ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        tree = self.tree
        return {"hit_tokens": self.hit_tokens, "lookup_tokens": self.lookup_tokens,
                "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
                "evicted_tokens": tree.evicted_tokens, "tree_tokens": tree.size,
                "evictable_tokens": tree.evictable_size, "unfiled_requests": self.unfiled_requests,
                "filing": self.filing}

    def take_writes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The table entries placed or repointed since the last call, as (flat table indices,
        slots), for the caller to mirror on the device before its next launch: a graphed prefill
        carries them in its own input copy (`PrefillIO`), anything else calls `upload`."""
        if not self._writes:
            return None
        writes, self._writes = self._writes, []
        total = sum(len(w[2]) for w in writes)
        flat, values = np.empty(total, np.int64), np.empty(total, np.int64)
        width, ramp, at = self.table.max_context, self._ramp, 0
        for row, first, slots in writes:
            n = len(slots)
            np.add(ramp[:n], row * width + first, out=flat[at:at + n])
            values[at:at + n] = slots
            at += n
        return flat, values

    def upload(self, writes: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Mirrors `take_writes`' entries on the device: one copy from a pinned buffer kept for it
        and one scatter (per request, the copies and launches cost ~18% of a loaded engine thread;
        pinning a new buffer each step, ~5%)."""
        if writes is None:
            return
        flat, values = writes
        total = len(flat)
        host = self._uploads.stage(2 * total)
        host[:total], host[total:] = flat, values
        flat_d, values_d = self._uploads.upload(2 * total).split(total)
        self.table.write_device_flat(flat_d, values_d)

    def write_device(self) -> None:
        """`take_writes` and `upload`: for a step that does not carry them itself."""
        self.upload(self.take_writes())
