"""The frontier's bookkeeping in an EAGLE draft depth (`eagle_step.DraftIO.step`), before and
after the head runs over it:
- `place_frontier`: each frontier node's scratch slot, its ancestors' slots in its virtual
  sequence's table row, its position and attention length;
- `advance_frontier`: from each request's K*K children (path scores and tokens, K per frontier
  node), the best K become the next frontier, and the depth's children and choices are recorded
  for the host.

One Triton launch each on CUDA instead of ~10 and ~20 small torch kernels (scatters, gathers, a
top-k, copies), which cost a graphed draft depth about as much GPU time as the head's decoder
layer; the torch reference runs elsewhere (and is the math the Triton kernels must match:
`tests/test_fused_kernels.py`).
"""
from __future__ import annotations

import torch

from ..kernels import uses_triton

try:
    import triton
    import triton.language as tl

    from ..kernels.triton_ops import select_topk
except Exception:  # noqa: BLE001 - CPU installs
    triton = None


def place_frontier(t: torch.Tensor, K: int, own_base: torch.Tensor, n_rep: torch.Tensor, anc: torch.Tensor,
                   draft_table: torch.Tensor, own: torch.Tensor, kv_lens: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """For the N = len(n_rep) frontier nodes at depth t [1] (1: the root's children): node i's
    scratch slot `own[i] = own_base[i] + (t - 1) * K` becomes its own ancestor column t - 1
    (anc [N, D]); its table row in `draft_table` [N, max_context] gets its ancestors' slots at
    columns n_rep[i] .. n_rep[i] + D - 1 (its request's context length n_rep; clamped to the
    row); its attention length kv_lens[i] = n_rep[i] + t (int32) and position n_rep[i] + t - 1."""
    N, D = anc.shape
    if uses_triton(anc):
        _place_kernel[(N,)](t, own_base, n_rep, anc, draft_table, own, kv_lens, positions, anc.stride(0),
                            draft_table.stride(0), draft_table.shape[1], D, K=K,
                            DBLOCK=triton.next_power_of_2(D), num_warps=1)
        return
    place_frontier_ref(t, K, own_base, n_rep, anc, draft_table, own, kv_lens, positions)


def place_frontier_ref(t, K, own_base, n_rep, anc, draft_table, own, kv_lens, positions) -> None:
    N, D = anc.shape
    own.copy_(own_base + (t - 1) * K)
    anc.scatter_(1, (t - 1).expand(N, 1), own[:, None])
    columns = (n_rep[:, None] + torch.arange(D, device=anc.device)).clamp_(max=draft_table.shape[1] - 1)
    draft_table.scatter_(1, columns, anc)
    kv_lens.copy_(n_rep + t)
    positions.copy_(n_rep + t - 1)


def advance_frontier(K: int, child_s: torch.Tensor, child_t: torch.Tensor, hidden: torch.Tensor, t: torch.Tensor,
                     anc: torch.Tensor, out_tok: torch.Tensor, out_score: torch.Tensor, out_best: torch.Tensor,
                     front_tok: torch.Tensor, front_score: torch.Tensor, parent_hidden: torch.Tensor) -> None:
    """child_s, child_t [B, K*K]: the children of request b's K frontier nodes (node j's at
    j*K .. j*K + K - 1), path scores and tokens; hidden [B*K, H]: the head's output at each
    frontier node; t [1]: the depth index the children are recorded at. In place: out_tok[b, t],
    out_score[b, t] (all K*K children) and out_best[b, t] (the K chosen, best first, by index
    among the children); the next frontier's tokens, scores (front_tok, front_score [B*K]),
    parents' outputs (parent_hidden [B*K, H]) and ancestor slots (anc [B*K, D]: the parent's row)."""
    B, KK = child_s.shape
    if uses_triton(child_s) and not K & (K - 1):
        H, D = hidden.shape[1], anc.shape[1]
        _advance_kernel[(B,)](child_s, child_t, hidden, t, anc, out_tok, out_score, out_best, front_tok, front_score,
                              parent_hidden, hidden.stride(0), parent_hidden.stride(0), anc.stride(0),
                              out_tok.stride(0), out_tok.stride(1), out_best.stride(0), out_best.stride(1), H, D,
                              K=K, KK=KK, HBLOCK=triton.next_power_of_2(H), DBLOCK=triton.next_power_of_2(D),
                              num_warps=4)
        return
    advance_frontier_ref(K, child_s, child_t, hidden, t, anc, out_tok, out_score, out_best, front_tok, front_score,
                         parent_hidden)


def advance_frontier_ref(K, child_s, child_t, hidden, t, anc, out_tok, out_score, out_best, front_tok, front_score,
                         parent_hidden) -> None:
    B, KK = child_s.shape
    best_s, best_i = child_s.topk(K, -1)
    depth = t.view(1, 1, 1).expand(B, 1, KK)
    out_tok[:B].scatter_(1, depth, child_t[:, None])
    out_score[:B].scatter_(1, depth, child_s[:, None])
    out_best[:B].scatter_(1, depth[:, :, :K], best_i[:, None])
    parent = (torch.arange(B, device=child_s.device)[:, None] * K + best_i // K).view(-1)
    front_tok[:B * K] = child_t.gather(1, best_i).view(-1)
    front_score[:B * K] = best_s.view(-1)
    parent_hidden[:B * K] = hidden.index_select(0, parent)
    anc[:B * K] = anc[:B * K].index_select(0, parent)


if triton is not None:
    @triton.jit
    def _place_kernel(t_ptr, own_base_ptr, n_rep_ptr, anc_ptr, table_ptr, own_ptr, kv_lens_ptr, pos_ptr,
                      anc_stride, table_stride, max_context, D, K: tl.constexpr, DBLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        t = tl.load(t_ptr)
        n = tl.load(n_rep_ptr + i)
        own = tl.load(own_base_ptr + i) + (t - 1) * K
        tl.store(own_ptr + i, own)
        tl.store(kv_lens_ptr + i, (n + t).to(tl.int32))
        tl.store(pos_ptr + i, n + t - 1)
        d = tl.arange(0, DBLOCK)
        live = d < D
        a = tl.load(anc_ptr + i * anc_stride + d, mask=live)
        a = tl.where(d == t - 1, own, a)
        tl.store(anc_ptr + i * anc_stride + d, a, mask=live)
        # columns past the row's end collapse on its last one, where the last ancestor wins (as in
        # the reference's scatter on the CPU)
        col = tl.minimum(n + d, max_context - 1)
        tl.store(table_ptr + i * table_stride + col, a, mask=live & ((n + d < max_context - 1) | (d == D - 1)))

    @triton.jit
    def _advance_kernel(cs_ptr, ct_ptr, hidden_ptr, t_ptr, anc_ptr, out_tok_ptr, out_score_ptr, out_best_ptr,
                        front_tok_ptr, front_score_ptr, parent_hidden_ptr, h_stride, ph_stride, anc_stride,
                        ot_stride0, ot_stride1, ob_stride0, ob_stride1, H, D,
                        K: tl.constexpr, KK: tl.constexpr, HBLOCK: tl.constexpr, DBLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.load(t_ptr)
        c = tl.arange(0, KK)
        s = tl.load(cs_ptr + b * KK + c)
        tok = tl.load(ct_ptr + b * KK + c)
        tl.store(out_tok_ptr + b * ot_stride0 + t * ot_stride1 + c, tok)
        tl.store(out_score_ptr + b * ot_stride0 + t * ot_stride1 + c, s)
        # the best K children, best first (ties: the lower index)
        ks = tl.arange(0, K)
        best_s, best = select_topk(s, c.to(tl.int64), K, KK)
        best_t = tl.sum(tl.where(c[None, :] == best[:, None], tok[None, :], 0), axis=1)
        tl.store(out_best_ptr + b * ob_stride0 + t * ob_stride1 + ks, best)
        node = b * K + ks
        tl.store(front_tok_ptr + node, best_t)
        tl.store(front_score_ptr + node, best_s)
        parent = b * K + best // K
        h = tl.arange(0, HBLOCK)
        hm = h[None, :] < H
        rows = tl.load(hidden_ptr + parent[:, None] * h_stride + h[None, :], mask=hm)
        tl.store(parent_hidden_ptr + node[:, None] * ph_stride + h[None, :], rows, mask=hm)
        d = tl.arange(0, DBLOCK)
        dm = d[None, :] < D
        a = tl.load(anc_ptr + parent[:, None] * anc_stride + d[None, :], mask=dm)  # all read before any write
        tl.debug_barrier()
        tl.store(anc_ptr + node[:, None] * anc_stride + d[None, :], a, mask=dm)
