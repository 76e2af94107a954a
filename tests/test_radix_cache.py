"""The radix tree alone: matching, insertion with splits, references, LRU eviction, slot accounting."""
import numpy as np
import pytest

from constrained_spec.engine.kv_cache import SlotPool
from constrained_spec.engine.radix_cache import RadixCache


def _tree():
    freed = []
    return RadixCache(lambda s: freed.extend(s.tolist())), freed


def test_match_returns_slots_of_the_longest_cached_prefix():
    tree, _ = _tree()
    assert tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13])) == 0
    slots, node = tree.match([1, 2, 3, 9, 9])
    assert slots.tolist() == [10, 11, 12]
    assert len(node) == 3  # the edge was split at the match's end
    assert tree.match([5])[0].tolist() == []
    assert tree.match([1, 2, 3, 4, 5])[0].tolist() == [10, 11, 12, 13]
    assert tree.match_length([1, 2, 7]) == 2
    assert tree.size == 4


def test_a_match_shorter_than_min_length_is_none_and_changes_nothing():
    """The prefix cache does not use a short match (`prefix_cache.min_match`): no slots, the root,
    and the tree as it was (no split where the match ends, no LRU touch)."""
    tree, freed = _tree()
    tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    tree.insert([5, 6], np.array([20, 21]))  # the newer leaf
    slots, node = tree.match([1, 2, 3, 9], min_length=4)
    assert slots.tolist() == [] and node is tree.root
    assert tree.num_nodes() == 2  # not split at [1, 2, 3]
    assert tree.match_length([1, 2, 3, 9], min_length=4) == 0 and tree.match_length([1, 2, 3, 9], 3) == 3
    assert tree.evict(1) == 4 and freed == [10, 11, 12, 13]  # still the least recently used
    tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    slots, node = tree.match([1, 2, 3, 9], min_length=3)  # long enough: used, and split there
    assert slots.tolist() == [10, 11, 12] and len(node) == 3 and tree.num_nodes() == 3


def test_insert_reports_the_already_cached_length_and_keeps_the_tree_slots():
    tree, _ = _tree()
    tree.insert([1, 2, 3], np.array([10, 11, 12]))
    # a second request computed the same first two tokens in its own slots, then diverged
    assert tree.insert([1, 2, 5, 6], np.array([20, 21, 22, 23])) == 2
    assert tree.match([1, 2, 5, 6])[0].tolist() == [10, 11, 22, 23]
    assert tree.match([1, 2, 3])[0].tolist() == [10, 11, 12]
    assert tree.size == 5
    assert sorted(tree.all_slots().tolist()) == [10, 11, 12, 22, 23]
    assert tree.insert([1, 2], np.array([30, 31])) == 2  # fully cached: nothing new


def test_inserts_ending_inside_an_edge_leave_it_whole_and_insert_path_cuts_it():
    """Identical answers of varied lengths (greedy, repeated prompts) add nothing past the longest;
    cutting the path at each length would leave one-token nodes for every later walk to visit."""
    tree, _ = _tree()
    tokens, slots = list(range(100, 200)), np.arange(1000, 1100)
    tree.insert(tokens, slots)
    for k in range(50, 100):
        assert tree.insert(tokens[:k], np.arange(k) + 5000) == k  # all duplicates
    assert tree.num_nodes() == 1 and tree.size == 100 and tree.evictable_size == 100
    cached, node = tree.insert_path(tokens[:60], np.arange(60) + 5000)
    assert cached == 60 and len(node) == 60  # a node spelling exactly the 60 tokens, to lock
    assert tree.num_nodes() == 2
    assert tree.match(tokens)[0].tolist() == slots.tolist()
    assert tree.evict(100) == 100 and tree.size == 0  # the touched edge stayed an eviction candidate


def test_locked_nodes_are_never_evicted_and_unlock_makes_them_evictable():
    tree, freed = _tree()
    tree.insert([1, 2, 3], np.array([10, 11, 12]))
    tree.insert([1, 2, 4], np.array([10, 11, 13]))
    _, node = tree.match([1, 2, 3])
    assert tree.evictable_size == 4
    assert tree.lock(node) == 3  # [1, 2] and [3] on its path
    assert tree.evictable_size == 1
    assert tree.evict(100) == 1  # only the [4] leaf
    assert freed == [13]
    assert tree.evict(100) == 0
    assert tree.unlock(node) == 3
    assert tree.evict(100) == 3
    assert sorted(freed) == [10, 11, 12, 13]
    assert tree.size == tree.evictable_size == 0
    with pytest.raises(RuntimeError):
        tree.unlock(node)


def test_a_split_keeps_the_references_of_the_node_it_cuts():
    tree, _ = _tree()
    tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    _, deep = tree.match([1, 2, 3, 4])
    tree.lock(deep)
    _, mid = tree.match([1, 2])  # splits the locked edge
    assert mid.refs == 1 and mid.parent is tree.root
    assert tree.evictable_size == 0
    assert tree.evict(10) == 0
    tree.unlock(deep)
    assert tree.evictable_size == 4


def test_eviction_goes_least_recently_used_first_and_climbs_to_parents():
    tree, freed = _tree()
    tree.insert([1, 2], np.array([10, 11]))
    tree.insert([1, 3], np.array([10, 12]))
    tree.insert([5, 6], np.array([20, 21]))
    tree.match([1, 3])  # touch: [1, 2] is now the oldest leaf under [1]
    assert tree.evict(1) == 1 and freed == [11]
    assert tree.evict(2) == 2 and freed[1:] == [20, 21]  # [5, 6]: older than [1, 3]
    assert tree.evict(2) == 2 and sorted(freed[3:]) == [10, 12]  # [3], then its parent [1]
    assert tree.num_nodes() == 0


def test_pool_with_cache_hands_out_evictable_slots():
    pool = SlotPool(9)  # 8 usable slots
    tree = RadixCache(pool.free)
    pool.cache = tree
    slots = pool.alloc(6)
    tree.insert(list(range(6)), slots)
    assert pool.num_free == 8  # 2 free + 6 evictable
    _, node = tree.match([0, 1, 2])
    tree.lock(node)
    assert pool.num_free == 5
    got = pool.alloc(5)  # evicts the unlocked [3, 4, 5]
    assert len(set(got.tolist()) | set(tree.all_slots().tolist())) == 8
    assert tree.size == 3 and pool.num_free == 0


def _start_one(tree, pool, held: list, tokens: list) -> bool:
    """A "request" for `tokens`: its cached prefix locked, slots for the rest; False if they do not fit."""
    prefix, node = tree.match(tokens)
    tree.lock(node)
    need = len(tokens) - len(prefix)
    if need > pool.num_free:
        tree.unlock(node)
        return False
    held.append((node, tokens, pool.alloc(need)))
    return True


def _finish_one(tree, pool, request) -> None:
    """A request's context into the tree, its duplicate slots freed, its reference dropped."""
    node, tokens, own = request
    cached = len(tokens) - len(own)
    dup = tree.insert(tokens, np.concatenate([tree.match(tokens[:cached])[0], own]))
    pool.free(own[:max(dup - cached, 0)])
    tree.unlock(node)


def test_random_workload_accounts_for_every_slot():
    rng = np.random.default_rng(0)
    pool = SlotPool(65)
    tree = RadixCache(pool.free)
    pool.cache = tree
    held = []  # (node, own slots) of live "requests"
    for _ in range(400):
        if held and (rng.random() < 0.5 or pool.num_free < 12):
            _finish_one(tree, pool, held.pop(int(rng.integers(len(held)))))
            continue
        if not _start_one(tree, pool, held, rng.integers(0, 3, size=int(rng.integers(2, 10))).tolist()):
            continue
        owned = np.concatenate([tree.all_slots()] + [h[2] for h in held])
        assert len(owned) == len(set(owned.tolist())), "a slot has two owners"
        assert len(owned) + pool._top == pool.capacity
    for node, tokens, own in held:
        pool.free(own)
        tree.unlock(node)
    assert tree.evictable_size == tree.size
    tree.evict(tree.size)
    assert pool.num_free == pool.capacity and tree.size == 0


def _lru_victim(tree):
    """The unreferenced leaf with the oldest last_access, by walking the whole tree (the reference
    the candidate heap must agree with)."""
    best, stack = None, [tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not tree.root and not node.children and node.refs == 0:
            if best is None or node.last_access < best.last_access:
                best = node
    return best


def test_eviction_order_matches_a_full_walk_under_random_traffic():
    rng = np.random.default_rng(1)
    pool = SlotPool(400)
    tree = RadixCache(pool.free)
    pool.cache = tree
    held = []
    for step in range(1500):
        r = rng.random()
        if held and r < 0.35:
            _finish_one(tree, pool, held.pop(int(rng.integers(len(held)))))
        elif r < 0.5 and tree.evictable_size:
            victim = _lru_victim(tree)
            expected = victim.slots.tolist()
            got = []
            tree._free_slots = lambda s: (got.extend(s.tolist()), pool.free(s))
            tree.evict(1)
            tree._free_slots = pool.free
            assert got == expected, f"step {step}: evicted {got}, the LRU leaf holds {expected}"
        else:
            _start_one(tree, pool, held, rng.integers(0, 4, size=int(rng.integers(2, 12))).tolist())
    assert len(tree._candidates) <= 2 * tree.num_nodes() + 64


def test_eviction_cost_does_not_grow_with_the_tree():
    """A pool full of cached distinct prompts evicts at every few admissions: each eviction must
    cost a few heap pops, not a walk over every leaf (which took ~30% of a loaded engine)."""
    import time
    tree, _ = _tree()
    for i in range(20_000):
        tree.insert([i, i + 1, i + 2], np.array([3 * i, 3 * i + 1, 3 * i + 2]))
    start = time.perf_counter()
    for _ in range(5_000):
        assert tree.evict(3) == 3
    elapsed = time.perf_counter() - start
    # a walk per call would take minutes here; the heap takes ~50 ms
    assert elapsed < 2.0, f"5,000 evictions from a 20,000-leaf tree took {elapsed:.2f} s"
    assert tree.num_nodes() == 15_000


def test_insert_below_a_locked_node_equals_insert_from_the_root():
    """Caching a request's prompt and answer from its matched node (`insert(tail, ..., below=node)`,
    which spares the walk over the cached prefix) leaves the tree and the duplicates as a walk from the
    root does, also when the node was split since it was locked and when others cached past it."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        trees = [_tree()[0], _tree()[0]]
        base = rng.integers(0, 4, 12).tolist()
        slot = iter(range(1000, 100000))
        for tree in trees:
            tree.insert(base, np.arange(12))
        prompt = base[:int(rng.integers(1, 12))] + rng.integers(0, 4, 6).tolist()
        nodes = []
        for tree in trees:
            slots, node = tree.match(prompt)
            tree.lock(node)
            nodes.append((node, len(slots)))
        others = [base[:int(rng.integers(0, 12))] + rng.integers(0, 4, 8).tolist() for _ in range(3)]
        for other in others:  # others cache meanwhile: splits above and below the node
            ids = np.array([next(slot) for _ in other])
            assert trees[0].insert(other, ids) == trees[1].insert(other, ids)
        full = prompt + rng.integers(0, 4, 10).tolist()
        ids = np.array([next(slot) for _ in full])
        dup_root = trees[0].insert(full, ids)
        node, n = nodes[1]  # what follows the locked node, from it
        dup_below = n + trees[1].insert(full[n:], ids[n:], below=node)
        assert dup_below == dup_root
        assert sorted(trees[0].all_slots().tolist()) == sorted(trees[1].all_slots().tolist())
        for probe in [full, prompt, *others, base]:
            assert trees[0].match(probe)[0].tolist() == trees[1].match(probe)[0].tolist()


def test_the_heads_set_follows_inserts_splits_and_evictions_and_answers_misses(monkeypatch):
    """With `head_len`, the tree's set of its paths' first head_len tokens stays equal to a walk's
    under random traffic (inserts from the root and below a locked node, splits, evictions), and a
    lookup that needs head_len tokens or more answers as a tree without the set does, without a walk
    where the head is not cached."""
    rng = np.random.default_rng(2)
    pool = SlotPool(200)
    tree = RadixCache(pool.free, head_len=4)
    pool.cache = tree
    held = []
    for step in range(1500):
        r = rng.random()
        if held and r < 0.4:
            node, tokens, own = held.pop(int(rng.integers(len(held))))
            cached = len(tokens) - len(own)
            # from the locked node, as `PrefixCache.release` does
            dup = tree.insert(tokens[cached:], own, below=node if cached else None)
            pool.free(own[:dup])
            tree.unlock(node)
        elif r < 0.5 and tree.evictable_size:
            tree.evict(int(rng.integers(1, 6)))
        else:
            _start_one(tree, pool, held, rng.integers(0, 3, size=int(rng.integers(2, 12))).tolist())
        assert tree.heads() == tree.all_heads(), f"step {step}"
        probe = rng.integers(0, 3, size=int(rng.integers(1, 10))).tolist()
        walked = tree.match_length(probe)  # min_length 0: a walk
        for min_length in (4, 5):
            assert tree.match_length(probe, min_length) == (walked if walked >= min_length else 0)
    assert tree.all_heads(), "the traffic cached paths of 4 tokens or more"
    small = RadixCache(lambda s: None, head_len=4)
    small.insert([1, 2, 3, 4, 5], np.arange(10, 15))
    from constrained_spec.engine import radix_cache
    monkeypatch.setattr(radix_cache, "_edge_match", None)  # a walk past the root would fail
    assert small.match([1, 2, 3, 9, 9], 4)[0].tolist() == [] and small.match_length([1, 2, 3, 9, 9], 4) == 0
    assert small.num_nodes() == 1  # not split
