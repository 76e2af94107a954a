"""Verification of draft trees against the target model, vectorized over the batch.

Inputs are per node: row i of ``logits``/``target_probs`` is the target's next-token distribution
after node i (node 0 = the last verified token), already grammar-masked (and, for sampling,
temperature/top-k/top-p processed). Pruned/padded nodes are never reachable through the links.

Both verifiers return a :class:`VerifyResult` of tensors, without host syncs (no ``.item()``):
  * ``accepted_nodes [B, N]``: node indices of the accepted path, root first; row b holds
    ``accept_lens[b] + 1`` entries, then -1. Keep these nodes' KV slots, free the others.
  * ``accept_lens [B]``: accepted draft tokens (root and bonus excluded).
  * ``bonus_tokens [B]``: the token sampled at the last accepted node.
  * ``emitted_tokens [B, N]``: the accepted draft tokens then the bonus token, -1 padded;
    ``num_emitted = accept_lens + 1`` tokens per request.
  * ``last_nodes [B]``: the deepest accepted node (its logits/hidden state produced the bonus).
:func:`greedy_accept_host` is greedy verification on the host, from the per-node argmax alone
(the speculative step's fast path: one small device-to-host copy, no kernel launches for the walk).

Rejection sampling is lossless for chains and trees (SpecInfer / SGLang-style recursive rejection):
at node u with target distribution p, the children c1, c2, ... are tried in sibling order; child c
with token x drawn from the draft distribution q_c is accepted with probability min(1, p(x)/q_c(x));
on rejection p <- normalize(max(p - q_c, 0)) and the next sibling is tried; when all are rejected
the bonus token is sampled from the residual p. On acceptance the walk continues at c with the
target distribution of c. Siblings must be i.i.d. draws from q (stochastic drafts, ``draft_probs``
given per node) or distinct deterministic tokens (``draft_probs=None``: q is one-hot on the drafted
token, so c is accepted with probability p(x) and the residual is p with x zeroed, renormalized).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .tree import DraftTrees, HostTrees

__all__ = ["HostAcceptance", "VerifyResult", "greedy_accept_host", "greedy_verify", "rejection_verify",
           "sample_from_probs"]


@dataclass
class VerifyResult:
    accepted_nodes: torch.Tensor  # [B, N] int64, -1 padded
    accept_lens: torch.Tensor  # [B] int64
    bonus_tokens: torch.Tensor  # [B] int64
    emitted_tokens: torch.Tensor  # [B, N] int64, -1 padded
    last_nodes: torch.Tensor  # [B] int64

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.accept_lens + 1


def _result(trees: DraftTrees, path: torch.Tensor, last: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    """path [B, N+1]: accepted node at each depth (-1 pad; column N unused/dump)."""
    b, n = trees.tokens.shape
    accepted = path[:, :n]
    accept_lens = (accepted >= 0).sum(-1) - 1
    tok = trees.tokens.gather(1, accepted.clamp(min=0))
    emitted = torch.full((b, n + 1), -1, dtype=torch.int64, device=trees.device)
    emitted[:, : n - 1] = torch.where(accepted[:, 1:] >= 0, tok[:, 1:], -1)
    emitted.scatter_(1, accept_lens[:, None], bonus[:, None].to(torch.int64))
    return VerifyResult(accepted, accept_lens, bonus.to(torch.int64), emitted[:, :n], last)


def greedy_verify(trees: DraftTrees, logits: torch.Tensor) -> VerifyResult:
    """Greedy: accept the longest root-to-node path on which every child's token equals the
    argmax of its parent's logits; bonus = argmax at the last accepted node. logits: [B, N, V]."""
    b, n = trees.tokens.shape
    dev = trees.device
    target = logits.argmax(-1).to(dev)  # [B, N]
    parents = trees.parents
    idx = torch.arange(n, device=dev)
    match = trees.tokens == target.gather(1, parents.clamp(min=0))
    match = (match & (parents >= 0)) | (idx == 0)[None, :]
    ok = ~(trees.mask & ~match[:, None, :]).any(-1) & trees.valid  # whole path matches
    depth = trees.depth
    score = torch.where(ok, depth * (n + 1) + (n - idx), -1)  # deepest, then lowest index
    last = score.argmax(-1)
    on_path = trees.mask.gather(1, last[:, None, None].expand(-1, 1, n)).squeeze(1)  # [B, N]
    path = torch.full((b, n + 1), -1, dtype=torch.int64, device=dev)
    path.scatter_(1, torch.where(on_path, depth, n), idx.expand(b, n).contiguous())
    path[:, n] = -1
    bonus = target.gather(1, last[:, None]).squeeze(1)
    return _result(trees, path, last, bonus)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sync-free categorical sampling over the last dim (exponential race: argmax p / E)."""
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.to(torch.float32) / e).argmax(-1)


def rejection_verify(trees: DraftTrees, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None,
                     greedy: torch.Tensor | None = None,
                     max_steps: int | None = None,
                     eps: float = 1e-12) -> VerifyResult:
    """Lossless rejection sampling over chains and trees.

    target_probs: [B, N, V], row i = target distribution after node i (processed, masked).
    draft_probs: None for deterministic drafters (n-gram), else [B, N, V] where row j is the
        distribution node j's token was drawn from (i.e. the drafter's distribution at j's parent;
        siblings drawn i.i.d. share it). Row 0 is unused.
    greedy: optional [B] bool; those rows use one-hot(argmax) target distributions, which makes
        the result identical to :func:`greedy_verify` for them.
    max_steps: loop bound (each step tests one candidate per request); default N-1, always
        sufficient. Pass ``max(num_nodes) - 1`` when known on the host to save work.
    """
    b, n = trees.tokens.shape
    dev = trees.device
    v = target_probs.shape[-1]
    target_probs = target_probs.to(dev)
    if greedy is not None:
        onehot = torch.nn.functional.one_hot(target_probs.argmax(-1), v).to(target_probs.dtype)
        target_probs = torch.where(greedy.to(dev)[:, None, None], onehot, target_probs)
    rows = torch.arange(b, device=dev)
    tokens, nxt, sib = trees.tokens, trees.next_token, trees.next_sibling
    u = torch.rand((b, n), generator=generator, device=dev, dtype=torch.float32)

    p = target_probs[:, 0].to(torch.float32).clone()  # residual target distribution [B, V]
    cur = torch.zeros(b, dtype=torch.int64, device=dev)
    cand = torch.where(trees.num_nodes > 0, nxt[:, 0], -1)
    depth = torch.zeros(b, dtype=torch.int64, device=dev)
    path = torch.full((b, n + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    steps = n - 1 if max_steps is None else min(max_steps, n - 1)
    for _ in range(steps):
        has = cand >= 0
        c = cand.clamp(min=0)
        x = tokens.gather(1, c[:, None])  # [B, 1]
        px = p.gather(1, x).squeeze(1)
        uc = u.gather(1, c[:, None]).squeeze(1)
        if draft_probs is None:
            accept = has & (uc < px)
            residual = p.scatter(1, x, 0.0)
        else:
            q = draft_probs[rows, c].to(torch.float32)  # [B, V]
            qx = q.gather(1, x).squeeze(1)
            accept = has & (uc * qx < px)  # u < p/q without dividing
            residual = (p - q).clamp_(min=0.0)
        reject = has & ~accept
        s = residual.sum(-1, keepdim=True)
        residual = torch.where(s > eps, residual / s.clamp(min=eps), p)
        depth = depth + accept.to(torch.int64)
        path.scatter_(1, torch.where(accept, depth, n)[:, None], c[:, None])
        cur = torch.where(accept, c, cur)
        p = torch.where(accept[:, None], target_probs[rows, c].to(torch.float32),
                        torch.where(reject[:, None], residual, p))
        cand = torch.where(accept, nxt.gather(1, c[:, None]).squeeze(1),
                           torch.where(reject, sib.gather(1, c[:, None]).squeeze(1), cand))
    path[:, n] = -1
    bonus = sample_from_probs(p, generator)
    return _result(trees, path, cur, bonus)


# ---------------------------------------------------------------------- host side
@dataclass
class HostAcceptance:
    """What a verify step accepted, as numpy arrays on the host (same meaning as VerifyResult)."""
    accepted_nodes: np.ndarray  # [B, N] int64: node at each depth of the accepted path, root first, -1 padded
    accept_lens: np.ndarray  # [B] int64: accepted draft tokens (root and bonus excluded)
    bonus_tokens: np.ndarray  # [B] int64

    def emitted_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """[B, N] int64: the accepted draft tokens then the bonus token, -1 padded."""
        b, n = tokens.shape
        path = self.accepted_nodes
        drafted = np.take_along_axis(tokens, np.maximum(path, 0), 1)
        out = np.full((b, n + 1), -1, np.int64)
        out[:, :n - 1] = np.where(path[:, 1:] >= 0, drafted[:, 1:], -1)
        out[np.arange(b), self.accept_lens] = self.bonus_tokens
        return out[:, :n]


def greedy_accept_host(trees: HostTrees, target: np.ndarray) -> HostAcceptance:
    """:func:`greedy_verify` on the host: target [B, N] = argmax of the masked logits at each node.

    Accepts the longest live root-to-node path on which every child's token is its parent's target
    (the deepest, then the lowest index); the bonus is the target at its last node. Cheap in numpy for
    the tiny [B, N] problem, and the target is the only thing read back from the device."""
    b, n = trees.shape
    idx = np.arange(n)
    rows = np.arange(b)
    parent_target = np.take_along_axis(target, np.maximum(trees.parents, 0), 1)
    match = (trees.tokens == parent_target) & (trees.parents >= 0)
    match[:, 0] = True
    ok = ~(trees.mask & ~match[:, None, :]).any(-1) & trees.live  # the whole path matches
    last = np.where(ok, trees.depth * (n + 1) + (n - idx), -1).argmax(-1)
    on_path = trees.mask[rows, last]
    path = np.full((b, n), -1, np.int64)
    pb, pj = np.nonzero(on_path)
    path[pb, trees.depth[pb, pj]] = pj
    return HostAcceptance(path, trees.depth[rows, last], target[rows, last].astype(np.int64))
