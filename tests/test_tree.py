"""DraftTrees: parents, depth, ancestor mask, pruning, bitmask helper."""
import random

import numpy as np
import pytest
import torch

from constrained_spec.speculative.tree import DraftTrees, allowed_from_bitmask

EXAMPLE = ([3, 4, 6, 5, 7, 9], [1, 3, 4, -1, -1, -1], [-1, 2, -1, 5, -1, -1])


def random_tree(rng: random.Random, n: int, shuffle: bool = True):
    """Random tree in xgrammar layout; node 0 root; other nodes in random index order."""
    parent = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    perm = list(range(1, n))
    if shuffle:
        rng.shuffle(perm)
    perm = [0] + perm  # logical node k -> index perm[k]
    children = {k: [] for k in range(n)}
    for k in range(1, n):
        children[parent[k]].append(k)
    tokens = [0] * n
    nxt = [-1] * n
    sib = [-1] * n
    par = [-1] * n
    for k in range(n):
        tokens[perm[k]] = rng.randrange(100)
        ch = children[k][:]
        rng.shuffle(ch)
        if ch:
            nxt[perm[k]] = perm[ch[0]]
        for a, b in zip(ch, ch[1:]):
            sib[perm[a]] = perm[b]
        for c in ch:
            par[perm[c]] = perm[k]
    return tokens, nxt, sib, par


def ref_structure(nxt, sib):
    n = len(nxt)
    par, depth = [-1] * n, [0] * n
    stack = [0]
    while stack:
        u = stack.pop()
        c = nxt[u]
        while c != -1:
            par[c], depth[c] = u, depth[u] + 1
            stack.append(c)
            c = sib[c]
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = par[j]
    return par, depth, mask


def ref_prune(tokens, nxt, sib, allowed):
    n = len(tokens)
    keep = [False] * n
    stack = [0]
    keep[0] = True
    while stack:
        u = stack.pop()
        c = nxt[u]
        while c != -1:
            if allowed[c]:
                keep[c] = True
                stack.append(c)
            c = sib[c]
    old = [i for i in range(n) if keep[i]]
    new = {o: k for k, o in enumerate(old)}

    def first_kept(j):
        while j != -1 and not keep[j]:
            j = sib[j]
        return new[j] if j != -1 else -1

    return ([tokens[o] for o in old], [first_kept(nxt[o]) for o in old],
            [first_kept(sib[o]) for o in old], old)


def test_example_by_hand():
    t = DraftTrees.from_lists([EXAMPLE])
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 2, 1]
    assert t.depth[0].tolist() == [0, 1, 1, 2, 2, 2]
    m = t.mask[0]
    assert m[3].tolist() == [True, True, False, True, False, False]
    assert m[4].tolist() == [True, False, True, False, True, False]
    assert m[0].tolist() == [True, False, False, False, False, False]


def test_chain_and_padding():
    t = DraftTrees.from_lists([([5, 6, 7], [1, 2, -1], [-1, -1, -1]), ([9], [-1], [-1])], width=4)
    assert t.tokens.shape == (2, 4)
    assert t.num_nodes.tolist() == [3, 1]
    assert t.parents.tolist() == [[-1, 0, 1, -1], [-1, -1, -1, -1]]
    assert t.depth.tolist() == [[0, 1, 2, 0], [0, 0, 0, 0]]
    # padded rows see only themselves (no empty attention rows)
    assert torch.equal(t.mask[1], torch.eye(4, dtype=torch.bool))
    assert torch.equal(t.mask[0, 3], torch.tensor([False, False, False, True]))
    c = DraftTrees.chains([5], [[6, 7]])
    assert c.next_token.tolist() == [[1, 2, -1]]


@pytest.mark.parametrize("seed", range(5))
def test_random_trees_match_reference(seed):
    rng = random.Random(seed)
    trees, refs = [], []
    for _ in range(6):
        n = rng.randint(1, 64)
        tok, nxt, sib, par = random_tree(rng, n)
        trees.append((tok, nxt, sib))
        refs.append(ref_structure(nxt, sib))
        assert refs[-1][0] == par
    t = DraftTrees.from_lists(trees, width=64)
    for b, (par, depth, mask) in enumerate(refs):
        n = len(par)
        assert t.parents[b, :n].tolist() == par
        assert t.depth[b, :n].tolist() == depth
        assert np.array_equal(t.mask[b, :n, :n].numpy(), mask)


@pytest.mark.parametrize("seed", range(5))
def test_prune_matches_reference(seed):
    rng = random.Random(100 + seed)
    trees, allowed = [], []
    for _ in range(5):
        n = rng.randint(1, 40)
        tok, nxt, sib, _ = random_tree(rng, n)
        trees.append((tok, nxt, sib))
        allowed.append([rng.random() < 0.7 for _ in range(n)] + [True] * (48 - n))
    t = DraftTrees.from_lists(trees, width=48)
    pruned, old_index = t.prune(torch.tensor(allowed))
    for b, (tok, nxt, sib) in enumerate(trees):
        rt, rn, rs, old = ref_prune(tok, nxt, sib, allowed[b])
        k = len(rt)
        assert int(pruned.num_nodes[b]) == k
        assert pruned.tokens[b, :k].tolist() == rt
        assert pruned.next_token[b, :k].tolist() == rn
        assert pruned.next_sibling[b, :k].tolist() == rs
        assert old_index[b, :k].tolist() == old
        assert (old_index[b, k:] == -1).all() and (pruned.next_token[b, k:] == -1).all()
    # the pruned layout is self-consistent
    for b in range(len(trees)):
        k = int(pruned.num_nodes[b])
        par, depth, _ = ref_structure(pruned.next_token[b, :k].tolist(), pruned.next_sibling[b, :k].tolist())
        assert pruned.parents[b, :k].tolist() == par


def test_prune_root_always_kept():
    t = DraftTrees.from_lists([EXAMPLE])
    pruned, old = t.prune(torch.zeros(1, 6, dtype=torch.bool))
    assert pruned.num_nodes.tolist() == [1]
    assert pruned.tokens[0, 0] == 3 and pruned.next_token[0].tolist() == [-1] * 6
    # drop node 1 (token 4) -> its children 3 and 5 go too
    pruned, old = t.prune(torch.tensor([[True, False, True, True, True, True]]))
    assert old[0].tolist() == [0, 2, 4, -1, -1, -1]
    assert pruned.tokens[0, :3].tolist() == [3, 6, 7]
    assert pruned.next_token[0, :3].tolist() == [1, 2, -1]


def test_allowed_from_bitmask():
    t = DraftTrees.from_lists([EXAMPLE])
    vocab_words = 1
    bm = torch.zeros(1, 6, vocab_words, dtype=torch.int32)
    # after root: tokens 4 and 6 allowed; after node 1 (token 4): only 9; after node 2: 7
    bm[0, 0, 0] = (1 << 4) | (1 << 6)
    bm[0, 1, 0] = 1 << 9
    bm[0, 2, 0] = 1 << 7
    allowed = allowed_from_bitmask(t, bm)
    assert allowed[0].tolist() == [True, True, True, False, True, True]
    # token 31 sets the sign bit of the int32 word
    t2 = DraftTrees.from_lists([([1, 31], [1, -1], [-1, -1])])
    bm2 = torch.tensor([[[-2147483648], [0]]], dtype=torch.int32)
    assert allowed_from_bitmask(t2, bm2)[0].tolist() == [True, True]
