"""Verification: greedy by hand; rejection sampling checked for losslessness with chi-square tests."""
import math

import pytest
import torch

from constrained_spec.speculative.tree import DraftTrees
from constrained_spec.speculative.verify import greedy_verify, rejection_verify

EXAMPLE = ([3, 4, 6, 5, 7, 9], [1, 3, 4, -1, -1, -1], [-1, 2, -1, 5, -1, -1])
V = 8


def logits_with_argmax(argmaxes, v=16):
    x = torch.zeros(len(argmaxes), v)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


# ------------------------------------------------------------------------------------ greedy
def test_greedy_chain_partial_accept():
    t = DraftTrees.chains([1], [[2, 3, 4]])
    logits = logits_with_argmax([2, 3, 5, 6])[None]
    r = greedy_verify(t, logits)
    assert r.accepted_nodes.tolist() == [[0, 1, 2, -1]]
    assert r.accept_lens.tolist() == [2]
    assert r.bonus_tokens.tolist() == [5]
    assert r.emitted_tokens.tolist() == [[2, 3, 5, -1]]
    assert r.last_nodes.tolist() == [2]
    assert r.num_emitted.tolist() == [3]


def test_greedy_chain_full_and_none():
    t = DraftTrees.chains([1, 1], [[2, 3], [2, 3]])
    logits = torch.stack([logits_with_argmax([2, 3, 9]), logits_with_argmax([7, 3, 9])])
    r = greedy_verify(t, logits)
    assert r.accept_lens.tolist() == [2, 0]
    assert r.emitted_tokens.tolist() == [[2, 3, 9], [7, -1, -1]]
    assert r.accepted_nodes.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert r.last_nodes.tolist() == [2, 0]


def test_greedy_tree_takes_matching_branch():
    # root 3 -> {4 -> {5, 9}, 6 -> {7}}; target: after 3 -> 6, after 6 -> 7, after 7 -> 8
    t = DraftTrees.from_lists([EXAMPLE])
    logits = logits_with_argmax([6, 9, 7, 0, 8, 0])[None]
    r = greedy_verify(t, logits)
    assert r.accepted_nodes.tolist() == [[0, 2, 4, -1, -1, -1]]
    assert r.emitted_tokens[0, :3].tolist() == [6, 7, 8]
    # second sibling at depth 2: after 3 -> 4, after 4 -> 9 (node 5), after 9 -> 11
    logits = logits_with_argmax([4, 9, 0, 0, 0, 11])[None]
    r = greedy_verify(t, logits)
    assert r.accepted_nodes.tolist() == [[0, 1, 5, -1, -1, -1]]
    assert r.emitted_tokens[0, :3].tolist() == [4, 9, 11]
    assert r.last_nodes.tolist() == [5]


def test_greedy_padded_batch():
    t = DraftTrees.from_lists([EXAMPLE, ([1, 2], [1, -1], [-1, -1]), ([5], [-1], [-1])])
    logits = torch.stack([logits_with_argmax([6, 0, 7, 0, 1, 0]),
                          logits_with_argmax([2, 12, 0, 0, 0, 0]),
                          logits_with_argmax([13, 0, 0, 0, 0, 0])])
    # make the padding logits of rows 1/2 point at tokens that would "match" if padding leaked
    r = greedy_verify(t, logits)
    assert r.accept_lens.tolist() == [2, 1, 0]
    assert r.emitted_tokens[:, :3].tolist() == [[6, 7, 1], [2, 12, -1], [13, -1, -1]]


def test_rejection_with_greedy_rows_equals_greedy():
    torch.manual_seed(0)
    t = DraftTrees.from_lists([EXAMPLE] * 4)
    logits = torch.randn(4, 6, 16)
    logits[:, 0, 6] = 10  # make node 2 accepted for some rows
    g = greedy_verify(t, logits)
    r = rejection_verify(t, torch.softmax(logits, -1), greedy=torch.ones(4, dtype=torch.bool))
    assert torch.equal(g.emitted_tokens, r.emitted_tokens)
    assert torch.equal(g.accepted_nodes, r.accepted_nodes)


# ------------------------------------------------------------------------- chi-square helpers
def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper critical value (alpha ~ 1e-4) by the Wilson-Hilferty approximation."""
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of observed counts [..., V] against probs [..., V] (rows = strata)."""
    counts = counts.double().reshape(-1, counts.shape[-1])
    probs = probs.double().reshape(-1, probs.shape[-1])
    n = counts.sum(-1, keepdim=True)
    exp = n * probs
    assert (counts[exp == 0] == 0).all(), "a token with zero target probability was emitted"
    use = exp > 0
    stat = ((counts - exp) ** 2 / exp.clamp(min=1e-300))[use].sum().item()
    dof = int((use.sum(-1) - 1).clamp(min=0)[n.squeeze(-1) > 0].sum().item())
    return stat, dof


def assert_matches(counts, probs):
    stat, dof = chi2_stat(counts, probs)
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof} crit={chi2_critical(dof):.1f}"


def markov_target(seed: int, zero_token: int | None = 5):
    """P[t] = target next-token distribution after token t (one token masked out)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.2, -1)
    if zero_token is not None:
        p[:, zero_token] = 0
        p = p / p.sum(-1, keepdim=True)
    return p


def node_probs(trees: DraftTrees, table: torch.Tensor) -> torch.Tensor:
    """[B, N, V]: row i = table[token of node i]."""
    return table[trees.tokens]


def first_two(res):
    y1 = res.emitted_tokens[:, 0]
    two = res.num_emitted >= 2
    return y1, two, res.emitted_tokens[:, 1]


def check_first_and_second(res, P, root_token):
    y1, two, y2 = first_two(res)
    assert_matches(torch.bincount(y1, minlength=V)[None], P[root_token][None])
    # given the first draft was accepted (y1 = a), the second emitted token ~ P[a]
    joint = torch.zeros(V, V, dtype=torch.long)
    joint.index_put_((y1[two], y2[two]), torch.ones(int(two.sum()), dtype=torch.long), accumulate=True)
    rows = joint.sum(-1) > 0
    assert rows.any()
    assert_matches(joint[rows], P[rows])


B = 120_000


# -------------------------------------------------------------------- deterministic drafts
def test_rejection_chain_deterministic_lossless():
    P = markov_target(1)
    root = 2
    drafts = [int(P[root].argmax()), 3, 5]  # includes a zero-probability token (5)
    t = DraftTrees.chains([root] * B, [drafts] * B)
    g = torch.Generator().manual_seed(11)
    res = rejection_verify(t, node_probs(t, P), generator=g)
    check_first_and_second(res, P, root)
    assert (res.accept_lens <= 2).all()  # token 5 has probability 0: never accepted
    assert (res.accept_lens >= 1).any()


def test_rejection_tree_deterministic_lossless():
    P = markov_target(2)
    root = 1
    # root -> {a -> {c, d}, b -> {e}, z}; z is the masked token
    a, b, c, d, e = 0, 3, 4, 6, 7
    tree = ([root, a, b, 5, c, d, e], [1, 4, 6, -1, -1, -1, -1], [-1, 2, 3, -1, 5, -1, -1])
    t = DraftTrees.from_lists([tree] * B)
    g = torch.Generator().manual_seed(12)
    res = rejection_verify(t, node_probs(t, P), generator=g)
    check_first_and_second(res, P, root)


# ----------------------------------------------------------------------- stochastic drafts
def sample_rows(probs: torch.Tensor, g) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=g).squeeze(-1)


def test_rejection_chain_stochastic_lossless():
    P = markov_target(3)
    Q = markov_target(4, zero_token=None)  # draft distribution differs from the target
    g = torch.Generator().manual_seed(13)
    root = 6
    k = 3
    toks = torch.full((B, k + 1), root, dtype=torch.long)
    for j in range(1, k + 1):
        toks[:, j] = sample_rows(Q[toks[:, j - 1]], g)
    t = DraftTrees.chains(toks[:, 0].tolist(), toks[:, 1:].tolist())
    q = torch.zeros(B, k + 1, V)
    q[:, 1:] = Q[toks[:, :-1]]  # row j = distribution node j was drawn from
    res = rejection_verify(t, node_probs(t, P), draft_probs=q, generator=g)
    check_first_and_second(res, P, root)


def test_rejection_tree_stochastic_lossless():
    """3 i.i.d. candidates at the root, each with one i.i.d.-drawn child (SpecInfer-style)."""
    P = markov_target(5)
    Q = markov_target(6, zero_token=None)
    g = torch.Generator().manual_seed(14)
    root = 0
    first = sample_rows(Q[root].expand(B * 3, V), g).view(B, 3)  # duplicates allowed
    second = sample_rows(Q[first.reshape(-1)], g).view(B, 3)
    # layout: 0 root; 1,2,3 = first-level candidates; 4,5,6 = their children
    toks = torch.cat([torch.full((B, 1), root), first, second], 1)
    nxt = torch.tensor([1, 4, 5, 6, -1, -1, -1]).expand(B, 7)
    sib = torch.tensor([-1, 2, 3, -1, -1, -1, -1]).expand(B, 7)
    t = DraftTrees.from_arrays(toks, nxt, sib)
    q = torch.zeros(B, 7, V)
    q[:, 1:4] = Q[root]
    q[:, 4:7] = Q[first]
    res = rejection_verify(t, node_probs(t, P), draft_probs=q, generator=g)
    check_first_and_second(res, P, root)


def test_chi2_has_power():
    """Sanity: the test rejects a slightly wrong distribution at this sample size."""
    P = markov_target(1)[2]
    g = torch.Generator().manual_seed(0)
    wrong = P.clone()
    wrong[0] += 0.03
    wrong = wrong / wrong.sum()
    counts = torch.bincount(torch.multinomial(wrong, B, replacement=True, generator=g), minlength=V)
    stat, dof = chi2_stat(counts[None], P[None])
    assert stat > chi2_critical(dof)
    good = torch.bincount(torch.multinomial(P, B, replacement=True, generator=g), minlength=V)
    assert_matches(good[None], P[None])


def test_naive_acceptance_is_detected():
    """Sanity: a lossy verifier (accept a draft whenever p(x) > 0) fails the same check."""
    P = markov_target(1)
    root = 2
    x = int(P[root].argmax())
    counts = torch.zeros(V, dtype=torch.long)
    counts[x] = B  # always accepted
    stat, dof = chi2_stat(counts[None], P[root][None])
    assert stat > chi2_critical(dof)
