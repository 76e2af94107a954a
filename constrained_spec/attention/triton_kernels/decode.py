"""Paged decode attention (flash-decoding) over a token-slot pool.

One new query token per sequence. Sequence b's context is `slot_table[b, :kv_lens[b]]`.
Grid (B, KVH, NUM_SPLITS): each program handles all G = H // KVH query heads that share one kv
head (so every K/V row is read once per kv head) and one contiguous chunk of the context. With one
split it writes the output directly (one launch). With several, each program writes a partial
output plus its log-sum-exp and a second launch, grid (B, H), merges the splits (`merge_splits`).
Merging inside the split launch instead (the last split program to finish, found with atomic
counters) is slower on the H100 (SmolLM2 shapes, slot table 8192 wide: the whole graphed decode
forward 1.378 vs 1.341 ms at batch 1 and 1.380 vs 1.340 ms at batch 32; one call 6.1 vs 4.7 us at
batch 1), so the merge stays a launch of its own.

RoPE and the KV store can be fused in (`rope=DecodeRope(...)`, what the engine's decode uses):
every program rotates its q heads; the split that owns the last context position (the new token)
rotates the new k, writes k and v into the pool and folds the token in from registers; the loop
never reads that slot. That removes the standalone RoPE + store launch of every layer.

CUDA-graph capturable: NUM_SPLITS and all grids depend only on B, H, KVH, D and the slot-table
width, never on host-side kv lengths. The chunk size per split is computed on the device from
kv_lens[b]. A sequence with kv_len == 0 gets an all-zero output (no NaN).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# The Triton CPU interpreter computes tl.dot on bf16 wrongly (numpy has no bf16): upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _upcast(q: torch.Tensor, k: torch.Tensor) -> bool:
    return _INTERPRET and torch.bfloat16 in (q.dtype, k.dtype)


def _dot_precision(q: torch.Tensor) -> str:
    # Triton rounds float32 dot inputs to TF32 (10-bit mantissa) by default: float32 runs are
    # our exactness reference, so they get IEEE dots. 16-bit inputs are exact in either mode.
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    Q, K, V, SlotTable, KvLens, Out, MidO, MidLse,
    KNew, VNew, Pos, CosSin, OutSlots,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_st,
    stride_ot, stride_oh,
    stride_mob, stride_moh, stride_mos,
    stride_lb, stride_lh,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs, stride_pos, stride_os,
    sm_scale_log2,
    NUM_SPLITS,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    kv_len = tl.load(KvLens + b)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < G
    d_mask = offs_d < D
    hd_mask = h_mask[:, None] & d_mask[None, :]
    heads = kvh * G + offs_h

    q_ptrs = Q + b * stride_qt + heads[:, None] * stride_qh
    if ROPE:
        cos, sin_signed, partner = _rope_coefficients(CosSin, Pos + b * stride_pos, stride_cs, offs_d, d_mask, D)
        q = _rotate(q_ptrs, offs_d, partner, hd_mask, cos, sin_signed).to(Q.dtype.element_ty)
        # The new token is the last context position; it is not in the pool yet: the split that
        # owns it takes it from the registers (and stores it), the loop stops before it.
        loop_end = tl.minimum(end, kv_len - 1)
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=hd_mask, other=0.0)
        loop_end = end
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    st_row = SlotTable + b.to(tl.int64) * stride_st
    for n0 in range(start, loop_end, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < loop_end
        slots = tl.load(st_row + cols, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [D, N]
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2  # [H, N], log2 domain
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [N, D]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if ROPE:
        owns_new = (start < kv_len) & (end == kv_len)
        store_mask = d_mask & (tl.zeros([BLOCK_D], dtype=tl.int32) + owns_new.to(tl.int32) != 0)
        k_new = _rotate(KNew + b * stride_knt + kvh * stride_knh, offs_d, partner, d_mask, cos,
                        sin_signed).to(K.dtype.element_ty)
        v_new = tl.load(VNew + b * stride_vnt + kvh * stride_vnh + offs_d, mask=d_mask, other=0.0
                        ).to(V.dtype.element_ty)
        slot = tl.load(OutSlots + b * stride_os).to(tl.int64)
        tl.store(K + slot * stride_ks + kvh * stride_kh + offs_d, k_new, mask=store_mask)
        tl.store(V + slot * stride_vs + kvh * stride_vh + offs_d, v_new, mask=store_mask)
        # the same rounding as the loop: K/V in the pool's dtype, p in V's dtype
        qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * sm_scale_log2
        qk = tl.where(owns_new, qk, float("-inf"))
        m_new = tl.maximum(m_i, qk)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if not SPLIT:
        tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=hd_mask)
    else:
        lse = tl.where((end > start) & (l_i > 0.0), m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
                 out, mask=hd_mask)
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _rope_coefficients(CosSin, PosPtr, stride_cs, offs_d, d_mask, D: tl.constexpr):
    """Rotate-half RoPE at position *PosPtr as per-column coefficients: x_rot = x * cos +
    x[partner] * sin_signed (the arithmetic of the standalone RoPE kernel, in float32)."""
    HALF: tl.constexpr = D // 2
    pos = tl.load(PosPtr).to(tl.int64)
    low = offs_d < HALF
    freq = tl.where(low, offs_d, offs_d - HALF)
    cos = tl.load(CosSin + pos * stride_cs + freq, mask=d_mask, other=0.0)
    sin = tl.load(CosSin + pos * stride_cs + HALF + freq, mask=d_mask, other=0.0)
    partner = tl.where(low, offs_d + HALF, offs_d - HALF)
    return cos, tl.where(low, -sin, sin), partner


@triton.jit
def _rotate(ptrs, offs_d, partner, mask, cos, sin_signed):
    """RoPE of the rows at `ptrs` (their columns `offs_d`), in float32."""
    x = tl.load(ptrs + offs_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(ptrs + partner, mask=mask, other=0.0).to(tl.float32)
    return x * cos + x_partner * sin_signed


@triton.jit
def _decode_reduce_kernel(
    MidO, MidLse, Out,
    stride_mob, stride_moh, stride_mos,
    stride_lb, stride_lh,
    stride_ot, stride_oh,
    NUM_SPLITS,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (rows, H): log-sum-exp merge of the splits' partial outputs of one (row, head); the
    merge launch of split decode and of split-prefix extend/verify."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    lse = tl.load(MidLse + row * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)
    o = tl.load(MidO + row * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + row * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


DEFAULT_TARGET_PROGRAMS = 512


class DecodeRope(NamedTuple):
    """The new token of each sequence, unrotated, for RoPE fused into decode attention:
    k, v [B, KVH, D]; positions [B]; cos_sin_cache float32 [max_pos, D] = cat(cos, sin);
    out_slots [B] (its pool slot, the last of its context)."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    out_slots: torch.Tensor


def default_num_splits(batch: int, num_kv_heads: int, table_width: int, max_splits: int = 32,
                       target_programs: int = DEFAULT_TARGET_PROGRAMS, block_n: int = 64) -> int:
    """A static split count: about `target_programs` programs in all (batch * kv heads * splits),
    at most `max_splits`, no more splits than table blocks."""
    want = max(1, math.ceil(target_programs / max(1, batch * num_kv_heads)))
    cap = max(1, math.ceil(table_width / block_n))
    return int(max(1, min(max_splits, want, cap)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None, max_splits: int = 32,
                     out: torch.Tensor | None = None,
                     target_programs: int = DEFAULT_TARGET_PROGRAMS,
                     rope: DecodeRope | None = None) -> torch.Tensor:
    """q: [B, H, D]; k_cache/v_cache: [num_slots, KVH, D]; slot_table: [B, W]; kv_lens: [B].

    `target_programs` and `max_splits` choose the split count when `num_splits` is None
    (`default_num_splits`). With `rope`, q and the new token's k are rotated in the kernel and the
    new k/v stored at `rope.out_slots` (the pool holds only the earlier context then), which saves
    the RoPE + store launch of every layer. Returns [B, H, D] in q's dtype. All launch parameters
    depend only on shapes."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    assert H % KVH == 0, "query heads must be a multiple of kv heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert slot_table.stride(-1) == 1
    G = H // KVH
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = max(16, triton.next_power_of_2(G))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    if num_splits is None:
        num_splits = default_num_splits(B, KVH, slot_table.shape[1], max_splits, target_programs, BLOCK_N)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if rope is not None and (D % 2 or rope.k.stride(-1) != 1 or rope.v.stride(-1) != 1
                             or rope.cos_sin_cache.stride(-1) != 1):
        raise ValueError("fused RoPE needs an even head dim and unit stride over it for k, v and cos/sin")
    split = num_splits > 1
    if split:
        mid_o = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused: the single split writes `out` directly
        mid_o = mid_lse = out
    r = rope or DecodeRope(q, q, kv_lens, q, kv_lens)  # unused when ROPE is off
    _decode_kernel[(B, KVH, num_splits)](
        q, k_cache, v_cache, slot_table, kv_lens, out, mid_o, mid_lse,
        r.k, r.v, r.positions, r.cos_sin_cache, r.out_slots,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        slot_table.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos_sin_cache.stride(0),
        r.positions.stride(0), r.out_slots.stride(0),
        scale * _LOG2E, num_splits,
        G=G, D=D, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SPLIT=split,
        UPCAST=_upcast(q, k_cache), DOT_PRECISION=_dot_precision(q), ROPE=rope is not None,
        num_warps=4, num_stages=2,
    )
    if split:
        merge_splits(mid_o, mid_lse, out, num_splits)
    return out


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """The merge launch: out[r, h] from the partial outputs mid_o [R, H, S, D] and their log-sum-exps
    mid_lse [R, H, S] (decode: a row per sequence; extend and verify: a row per new token)."""
    R, H, _, D = mid_o.shape
    BLOCK_D = triton.next_power_of_2(D)
    _decode_reduce_kernel[(R, H)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        D=D, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=BLOCK_D,
        num_warps=4 if BLOCK_D >= 128 else 2,
    )
