"""Extend (prefill over a cached prefix) and tree-verify attention over a token-slot pool.

Sequence b has q_lens[b] new tokens (flat rows q_starts[b] .. q_starts[b] + q_lens[b]) which are the
last q_lens[b] entries of its context `slot_table[b, :kv_lens[b]]`; prefix = kv_lens[b] - q_lens[b]
cached tokens come before them and are fully visible. Among the new tokens the mask is causal
(EXTEND) or `tree_mask[b, i, j]` (VERIFY: new token i sees new token j).

GQA packing: a program owns one sequence, one kv head and BLOCK_M "rows", where row r is
(new token r // G, query head kvh * G + r % G); so the G query heads sharing a kv head share every
K/V load, and short verify trees still fill the tensor-core tile.
Grid: (cdiv(T * G, BLOCK_M) + B, KVH, NUM_SPLITS), T the flat new-token count: the sequences' row
blocks numbered one after the other (sequence b has cdiv(q_lens[b] * G, BLOCK_M) of them; each
program finds its own from q_lens), so the grid holds about as many programs as there is work,
however the T tokens are shared out, and depends on T and B alone: static, hence capturable (a
graphed prefill of many requests would otherwise launch B * cdiv(T * G, BLOCK_M) programs, mostly
empty). Programs past the last block exit. When the grid is too small to fill the GPU (short trees
over long contexts), the cached prefix is split into NUM_SPLITS chunks (chosen from static shapes),
each split writes a partial output + log-sum-exp, the last split also covers the new tokens, and the
decode reduce kernel merges them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .decode import _dot_precision, merge_splits

_LOG2E = 1.4426950408889634
# The Triton CPU interpreter computes tl.dot on bf16 wrongly (numpy has no bf16): upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _upcast(q: torch.Tensor, k: torch.Tensor) -> bool:
    return _INTERPRET and torch.bfloat16 in (q.dtype, k.dtype)


# B (the sequences) is neither specialized nor a block size of its own up to MIN_BLOCK_B: eager
# extends (prompt chunks, the EAGLE head's catch-up) come with every batch size, and each new Triton
# variant compiles on the step that first meets it (on the H200, 0.9 s: the first EAGLE step at 33
# requests compiled a BLOCK_B of 64 that no graph capture had met). Scanning 128 lengths instead of
# next_pow2(B) costs 0.3 us of a ~10.5 us launch at B=1 and 0-1.6% at 8-64 (H200, graph-replayed).
MIN_BLOCK_B = 128


@triton.jit(do_not_specialize=["B"])
def _extend_kernel(
    Q, K, V, O, SlotTable, KvLens, QStarts, QLens, TreeMask, MidO, MidLse,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_st,
    stride_tb, stride_ti, stride_tj,
    stride_mot, stride_moh, stride_mos, stride_lt, stride_lh,
    sm_scale_log2, NUM_SPLITS,
    B, G: tl.constexpr, D: tl.constexpr, IS_TREE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # which sequence, and which of its row blocks, this program owns (see the grid above)
    block = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_b = tl.arange(0, BLOCK_B)
    blocks = (tl.load(QLens + offs_b, mask=offs_b < B, other=0) * G + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    b = tl.sum((ends <= block).to(tl.int32), 0)
    mblk = block - tl.sum(tl.where(offs_b == b, ends - blocks, 0), 0)

    q_len = tl.load(QLens + b, mask=b < B, other=0)
    row0 = mblk * BLOCK_M
    if row0 < q_len * G:
        q_start = tl.load(QStarts + b).to(tl.int64)
        kv_len = tl.load(KvLens + b)
        prefix = kv_len - q_len

        rows = row0 + tl.arange(0, BLOCK_M)
        tok = rows // G
        head = kvh * G + rows % G
        row_mask = tok < q_len
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_mask = offs_d < D

        q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        st_row = SlotTable + b.to(tl.int64) * stride_st

        # Phase 1: the cached prefix, visible to every new token (one chunk of it per split).
        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
            p_start = split * chunk
            p_end = tl.minimum(p_start + chunk, prefix)
        else:
            p_start = 0
            p_end = prefix
        for n0 in range(p_start, p_end, BLOCK_N):
            cols = n0 + offs_n
            n_mask = cols < p_end
            slots = tl.load(st_row + cols, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(K + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                        mask=n_mask[None, :] & d_mask[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Phase 2: the new tokens, causal or tree-masked (done by the last split).
        if IS_TREE:
            end = kv_len
        else:
            last_tok = tl.minimum(q_len - 1, (row0 + BLOCK_M - 1) // G)
            end = prefix + last_tok + 1
        if SPLIT:
            if split != NUM_SPLITS - 1:
                end = prefix
        for n0 in range(prefix, end, BLOCK_N):
            cols = n0 + offs_n
            n_mask = cols < end
            rel = cols - prefix
            slots = tl.load(st_row + cols, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(K + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                        mask=n_mask[None, :] & d_mask[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
            if IS_TREE:
                tm = tl.load(TreeMask + b * stride_tb + tok[:, None] * stride_ti + rel[None, :] * stride_tj,
                             mask=row_mask[:, None] & n_mask[None, :], other=0)
                vis = (tm != 0) & n_mask[None, :]
            else:
                vis = (rel[None, :] <= tok[:, None]) & n_mask[None, :]
            qk = tl.where(vis, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if SPLIT:
            t = q_start + tok
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(MidO + t[:, None] * stride_mot + head[:, None] * stride_moh + split * stride_mos
                     + offs_d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])
            tl.store(MidLse + t * stride_lt + head * stride_lh + split, lse, mask=row_mask)
        else:
            tl.store(O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_table: torch.Tensor, kv_lens: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, scale: float,
                     tree_mask: torch.Tensor | None = None,
                     out: torch.Tensor | None = None,
                     block_m: int | None = None, block_n: int | None = None,
                     num_splits: int | None = None, max_splits: int = 16) -> torch.Tensor:
    """q: [T, H, D] flat new tokens; k_cache/v_cache: [num_slots, KVH, D]; slot_table: [B, W];
    kv_lens/q_starts[:B]/q_lens: [B]; tree_mask: optional [B, >=q_len, >=q_len] bool.
    The new tokens of sequence b are rows q_starts[b] .. + q_lens[b] of q; sum(q_lens) <= T."""
    T, H, D = q.shape
    B = q_lens.shape[0]
    KVH = k_cache.shape[1]
    assert H % KVH == 0, "query heads must be a multiple of kv heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert slot_table.stride(-1) == 1
    G = H // KVH
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_M = block_m or (64 if BLOCK_D <= 128 else 32)
    BLOCK_N = block_n or (64 if BLOCK_D <= 64 else 32)
    is_tree = tree_mask is not None
    if is_tree:
        tm = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        tstrides = (tm.stride(0), tm.stride(1), tm.stride(2))
    else:
        tm = kv_lens  # unused dummy pointer
        tstrides = (0, 0, 0)
    n_blocks = triton.cdiv(T * G, BLOCK_M) + B  # each sequence's last block may be partial
    if num_splits is None:
        num_splits = default_extend_splits(KVH, triton.cdiv(T * G, BLOCK_M), slot_table.shape[1], max_splits)
    split = num_splits > 1
    if split:
        mid_o = torch.empty((T, H, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    else:
        mid_o = mid_lse = out  # unused
        mstrides = (0, 0, 0, 0, 0)
    grid = (n_blocks, KVH, num_splits)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, slot_table, kv_lens, q_starts, q_lens, tm, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        slot_table.stride(0),
        *tstrides, *mstrides,
        scale * _LOG2E, num_splits,
        B, G=G, D=D, IS_TREE=is_tree, SPLIT=split, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        BLOCK_B=max(MIN_BLOCK_B, triton.next_power_of_2(B)),
        UPCAST=_upcast(q, k_cache), DOT_PRECISION=_dot_precision(q),
        num_warps=4, num_stages=2,
    )
    if split:
        # Every (t, h) of a new token has been written by every split; rows past sum(q_lens)
        # (a graph's padding) merge garbage that nothing reads.
        merge_splits(mid_o, mid_lse, out, num_splits)
    return out


def default_extend_splits(num_kv_heads: int, row_blocks: int, table_width: int,
                          max_splits: int = 16, target_programs: int = 264, min_chunk: int = 256) -> int:
    """Static split count of the cached prefix: only when the grid alone cannot fill the GPU."""
    programs = max(1, num_kv_heads * row_blocks)
    if programs >= target_programs // 2:
        return 1
    want = -(-target_programs // programs)
    cap = max(1, table_width // min_chunk)
    return int(max(1, min(max_splits, want, cap)))
