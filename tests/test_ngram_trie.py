"""Native n-gram lookahead trie (constrained_spec._native.NgramTrie) and the NgramDrafter."""
import random
import threading

import numpy as np
import pytest
import torch

from constrained_spec._native import NgramTrie
from constrained_spec.speculative.drafter import DraftBatch
from constrained_spec.speculative.ngram import NgramDrafter
from constrained_spec.speculative.tree import DraftTrees


def check_layout(tokens, nxt, sib, n_max, branches):
    """Valid xgrammar layout: node 0 root, parents before children, every node reachable once,
    at most `branches` distinct-token children per node. Returns the root-to-node token paths."""
    n = len(tokens)
    assert 1 <= n <= n_max
    seen = [False] * n
    paths = {0: []}
    stack = [0]
    seen[0] = True
    while stack:
        u = stack.pop()
        kids = []
        c = nxt[u]
        while c != -1:
            assert 0 < c < n and c > u and not seen[c]
            seen[c] = True
            kids.append(c)
            paths[c] = paths[u] + [int(tokens[c])]
            stack.append(c)
            c = sib[c]
        assert len(kids) <= branches
        assert len({int(tokens[k]) for k in kids}) == len(kids)
    assert all(seen)
    return paths


def test_insert_match_and_frequency():
    t = NgramTrie(max_ngram=3, num_draft_tokens=6, branches=2, capacity=1000)
    t.insert(1, [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3, 4, 9])
    assert t.frequency([1, 2, 3]) == 3
    assert t.frequency([1, 2, 3, 4]) == 2
    assert t.frequency([2, 3, 6]) == 1 and t.frequency([3, 3]) == 0
    assert t.frequency([1, 2, 3, 4], 1) == 2  # the request's own trie
    tok, nxt, sib = t.propose(1, [8, 1, 2, 3])
    # root 3 -> {4 (freq 2) -> {5, 9}, 6 (freq 1) -> {7}}, best first
    assert tok.tolist() == [3, 4, 6, 5, 7, 9]
    assert nxt.tolist() == [1, 3, 4, -1, -1, -1]
    assert sib.tolist() == [-1, 2, -1, 5, -1, -1]
    assert tok.dtype == np.int32


def test_chain_follows_most_frequent():
    t = NgramTrie(max_ngram=4, num_draft_tokens=5, branches=1)
    t.insert(-1, [10, 11, 12, 13, 14, 15] * 3 + [10, 11, 99])
    tok, nxt, sib = t.propose(7, [5, 10, 11])
    assert tok.tolist() == [11, 12, 13, 14, 15]
    assert nxt.tolist() == [1, 2, 3, 4, -1] and (sib == -1).all()
    # no match at all -> the root alone
    tok, nxt, sib = t.propose(7, [1000])
    assert tok.tolist() == [1000] and nxt.tolist() == [-1]
    # empty context, unknown request -> no tree
    assert len(t.propose(7)[0]) == 0


def test_longest_suffix_wins():
    t = NgramTrie(max_ngram=3, num_draft_tokens=2, branches=1)
    t.insert(-1, [1, 2, 3, 50] + [9, 2, 3, 60] * 4)
    assert t.propose(0, [1, 2, 3])[0].tolist() == [3, 50]  # 3-gram match beats frequency
    assert t.propose(0, [7, 2, 3])[0].tolist() == [3, 60]
    assert t.propose(0, [1, 2, 3], max_ngram=2)[0].tolist() == [3, 60]
    assert t.propose(0, [7, 7, 3], min_ngram=2)[0].tolist() == [3]


def test_branch_ranking_by_frequency():
    t = NgramTrie(max_ngram=2, num_draft_tokens=4, branches=3)
    for tail, reps in ((3, 3), (4, 2), (5, 1), (6, 1)):
        for _ in range(reps):
            t.insert(-1, [1, 2, tail])
    tok, nxt, sib = t.propose(0, [1, 2])
    assert tok.tolist() == [2, 3, 4, 5]  # 6 is cut by branches=3 (tie with 5 broken by token id)
    assert nxt.tolist() == [1, -1, -1, -1] and sib.tolist() == [-1, 2, 3, -1]
    tok, _, _ = t.propose(0, [1, 2], branches=2)
    assert tok.tolist()[:3] == [2, 3, 4] and 5 not in tok.tolist()


def test_own_request_first():
    t = NgramTrie(max_ngram=2, num_draft_tokens=3, branches=2)
    for _ in range(5):
        t.insert(-1, [7, 8, 9])
    t.insert(1, [7, 8, 6])  # the request's own prompt continues 7 8 with 6, once
    t.insert(2, [1, 1])
    assert t.propose(1, [7, 8])[0].tolist() == [8, 6, 9]
    assert t.propose(2, [7, 8])[0].tolist() == [8, 9, 6]
    assert t.has_request(1) and t.num_requests() == 2
    t.remove_request(1)
    assert not t.has_request(1) and t.request_num_nodes(1) == -1
    assert t.propose(1, [7, 8])[0].tolist() == [8, 9, 6]
    # the request's context comes from its stored stream when none is given
    t.insert(2, [7, 8])
    assert t.request_history(2).tolist() == [1, 1, 7, 8]
    assert t.propose(2)[0].tolist() == [8, 9, 6]


def test_incremental_insert_equals_one_shot():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(300)]
    a = NgramTrie(max_ngram=3, num_draft_tokens=4)
    b = NgramTrie(max_ngram=3, num_draft_tokens=4)
    a.insert(1, seq)
    i = 0
    while i < len(seq):
        k = rng.randint(1, 7)
        b.insert(1, seq[i:i + k])
        i += k
    assert a.num_nodes() == b.num_nodes() and a.request_num_nodes(1) == b.request_num_nodes(1)
    for _ in range(200):
        g = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        assert a.frequency(g) == b.frequency(g) == a.frequency(g, 1) == b.frequency(g, 1)
        ref = sum(seq[s:s + len(g)] == g for s in range(len(seq)))
        assert a.frequency(g) == ref  # window = 3 + 4 - 1 = 6 >= len(g)


def test_eviction_at_capacity_lru():
    cap = 200
    t = NgramTrie(max_ngram=3, num_draft_tokens=3, capacity=cap, request_capacity=64)
    rng = random.Random(1)
    old = [1000, 1001, 1002, 1003]
    t.insert(-1, old)
    assert t.frequency(old) == 1
    for step in range(50):
        t.insert(-1, [rng.randrange(500) for _ in range(20)])
        assert t.num_nodes() <= cap
    assert t.frequency(old[:2]) == 0  # least recently used: gone
    # a recently inserted n-gram survives
    recent = [2000, 2001, 2002]
    t.insert(-1, recent)
    assert t.frequency(recent) == 1 and t.num_nodes() <= cap
    # per-request tries are bounded too
    t.insert(5, [rng.randrange(500) for _ in range(200)])
    assert 0 < t.request_num_nodes(5) <= 64 and t.num_nodes() <= cap


def test_used_ngrams_survive_eviction():
    cap = 120
    t = NgramTrie(max_ngram=2, num_draft_tokens=3, capacity=cap)
    keep = [900, 901, 902, 903]
    t.insert(-1, keep)
    rng = random.Random(2)
    for _ in range(40):
        t.propose(0, [900, 901])  # drafting from it refreshes it
        t.insert(-1, [rng.randrange(300) for _ in range(8)])
    assert t.propose(0, [900, 901])[0].tolist() == [901, 902, 903]


@pytest.mark.parametrize("branches", [1, 2, 4])
def test_tree_layout_validity_random(branches):
    rng = random.Random(branches)
    corpus = [rng.randrange(12) for _ in range(3000)]
    t = NgramTrie(max_ngram=4, num_draft_tokens=16, branches=branches)
    t.insert(3, corpus[:1500])
    t.insert(-1, corpus[1500:])
    for _ in range(100):
        s = rng.randrange(len(corpus) - 6)
        ctx = corpus[s:s + rng.randint(1, 6)]
        tok, nxt, sib = t.propose(3, ctx)
        assert tok[0] == ctx[-1]
        paths = check_layout(tok, nxt, sib, 16, branches)
        if branches > 1:
            assert len(tok) == 16  # random corpus: plenty of continuations
        for path in paths.values():
            assert t.frequency([ctx[-1]] + path) > 0  # every drafted path occurred
        tree = DraftTrees.from_arrays(tok, nxt, sib)
        assert tree.depth[0].tolist() == [len(paths[i]) for i in range(len(tok))]


def test_batch_api_matches_single():
    rng = random.Random(4)
    t = NgramTrie(max_ngram=3, num_draft_tokens=8, branches=2)
    streams = {r: [rng.randrange(10) for _ in range(200)] for r in range(4)}
    t.insert_batch(list(streams), [np.asarray(s, np.int64) for s in streams.values()])
    ids = [0, 1, 2, 3, 99]
    ctxs = [streams[0][-5:], None, [3, 4], streams[3][:50], []]
    tok, nxt, sib, counts = t.propose_batch(ids, ctxs)
    assert tok.shape == (5, 8) and counts.dtype == np.int32
    for b, (r, c) in enumerate(zip(ids, ctxs)):
        one = t.propose(r, c if c is None else np.asarray(c))
        k = counts[b]
        assert k == len(one[0])
        assert tok[b, :k].tolist() == one[0].tolist()
        assert nxt[b, :k].tolist() == one[1].tolist() and sib[b, :k].tolist() == one[2].tolist()
        assert (nxt[b, k:] == -1).all() and (tok[b, k:] == 0).all()
    assert counts[4] == 0  # empty context
    assert tok[1, 0] == streams[1][-1]  # None: stored stream
    # stored streams for the whole batch, and a width override
    tok2, _, _, counts2 = t.propose_batch([0, 1], None, num_draft_tokens=4)
    assert tok2.shape == (2, 4) and tok2[0, 0] == streams[0][-1]


def test_concurrent_use_is_safe():
    t = NgramTrie(max_ngram=3, num_draft_tokens=8, branches=2, capacity=5000)
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            for i in range(200):
                t.insert(seed, [rng.randrange(30) for _ in range(5)])
                tok, nxt, sib, c = t.propose_batch([seed, (seed + 1) % 4])
                for b in range(2):
                    if c[b]:
                        check_layout(tok[b, :c[b]], nxt[b, :c[b]], sib[b, :c[b]], 8, 2)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and t.num_nodes() <= 5000


def test_config_validation():
    with pytest.raises(ValueError):
        NgramTrie(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramTrie(branches=0)
    assert NgramTrie(max_ngram=4, num_draft_tokens=6).config["window"] == 9


def test_ngram_drafter_protocol():
    d = NgramDrafter(max_ngram=3, num_draft_tokens=5, branches=1, capacity=10_000)
    d.add_request("a", [5, 6, 7, 8, 9, 5, 6])
    d.add_request("b", [1, 2])
    trees = d.propose(DraftBatch(["a", "b"]))
    assert isinstance(trees, DraftTrees) and trees.tokens.dtype == torch.int64
    assert trees.tokens.shape == (2, 5)
    assert trees.tokens[0].tolist() == [6, 7, 8, 9, 5]
    assert trees.num_nodes.tolist() == [5, 1]
    d.observe("a", [7, 8])
    d.observe_batch(["a", "b"], [[9], [3]])
    trees = d.propose(DraftBatch(["a", "b"], contexts=[[1, 5, 6, 7, 8, 9], [1, 2]]))
    assert trees.tokens[0, :3].tolist() == [9, 5, 6]
    # b's own stream (1, 2, 3) makes 2 -> 3 the draft
    assert trees.tokens[1, :2].tolist() == [2, 3]
    d.finish("a")
    assert not d.trie.has_request(0)


def test_eviction_large_trie_sampled_threshold():
    """Above 64k nodes the eviction cut comes from a sample; the capacity still holds."""
    cap = 80_000
    t = NgramTrie(max_ngram=4, num_draft_tokens=5, capacity=cap)
    rng = np.random.default_rng(0)
    old = [70_000, 70_001, 70_002]
    t.insert(-1, old)
    for _ in range(30):
        t.insert(-1, rng.integers(0, 5000, 1000))
        assert t.num_nodes() <= cap
    assert t.num_nodes() > cap // 2
    assert t.frequency(old[:1]) == 0
    recent = rng.integers(0, 5000, 50)
    t.insert(-1, recent)
    assert t.frequency(recent[:4]) >= 1
