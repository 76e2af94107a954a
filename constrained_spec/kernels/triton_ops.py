"""Triton kernels for the fused ops (one launch each). Arithmetic in float32, I/O in the tensor dtype.

Rounding mirrors the torch reference where it is cheap to: the residual sum is rounded to the
activation dtype before it is normalized, the normalized row is rounded before the weight multiply,
and silu(gate) is rounded before the multiply by `up`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
                     x_stride, r_stride, out_stride, res_out_stride,
                     N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's x + residual
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _norm_launch_cfg(N: int) -> tuple[int, int]:
    BLOCK = triton.next_power_of_2(N)
    num_warps = 1 if BLOCK <= 256 else 2 if BLOCK <= 1024 else 4 if BLOCK <= 4096 else 8
    return BLOCK, num_warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    BLOCK, num_warps = _norm_launch_cfg(N)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, N, eps,
                                         HAS_RESIDUAL=False, BLOCK=BLOCK, num_warps=num_warps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes x + residual into `residual` and the normed sum into `x` (in place when both are
    row-contiguous and the weight dtype matches x; otherwise into new tensors)."""
    N = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    in_place = (x2.data_ptr() == x.data_ptr() and r2.data_ptr() == residual.data_ptr()
                and weight.dtype == x.dtype and residual.dtype == x.dtype)
    if in_place:
        out, res_out = x2, r2
    else:
        out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    BLOCK, num_warps = _norm_launch_cfg(N)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                         res_out.stride(0), N, eps, HAS_RESIDUAL=True, BLOCK=BLOCK,
                                         num_warps=num_warps)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr,
                 q_stride_t, q_stride_h, k_stride_t, k_stride_h, cs_stride, pos_stride,
                 H, KVH,
                 v_ptr, kc_ptr, vc_ptr, slot_ptr,
                 v_stride_t, v_stride_h, kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, slot_stride,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * pos_stride).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cs_ptr + pos * cs_stride + d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * cs_stride + HALF + d, mask=dmask, other=0.0)[None, :]
    h = tl.arange(0, BLOCK_H)
    # q
    qmask = (h[:, None] < H) & dmask[None, :]
    q1p = q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :]
    q1 = tl.load(q1p, mask=qmask, other=0.0)
    q2 = tl.load(q1p + HALF, mask=qmask, other=0.0)
    q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(q1p, (q1f * cos - q2f * sin).to(q1.dtype), mask=qmask)
    tl.store(q1p + HALF, (q2f * cos + q1f * sin).to(q1.dtype), mask=qmask)
    # k
    kmask = (h[:, None] < KVH) & dmask[None, :]
    k1p = k_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :]
    k1 = tl.load(k1p, mask=kmask, other=0.0)
    k2 = tl.load(k1p + HALF, mask=kmask, other=0.0)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    k_lo, k_hi = (k1f * cos - k2f * sin).to(k1.dtype), (k2f * cos + k1f * sin).to(k1.dtype)
    if STORE:  # write rotated k and v straight into their KV-cache slot (saves two launches a layer)
        slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
        kcp = kc_ptr + slot * kc_stride_s + h[:, None] * kc_stride_h + d[None, :]
        tl.store(kcp, k_lo.to(kc_ptr.dtype.element_ty), mask=kmask)
        tl.store(kcp + HALF, k_hi.to(kc_ptr.dtype.element_ty), mask=kmask)
        vp = v_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :]
        vcp = vc_ptr + slot * vc_stride_s + h[:, None] * vc_stride_h + d[None, :]
        tl.store(vcp, tl.load(vp, mask=kmask, other=0.0).to(vc_ptr.dtype.element_ty), mask=kmask)
        tl.store(vcp + HALF, tl.load(vp + HALF, mask=kmask, other=0.0).to(vc_ptr.dtype.element_ty), mask=kmask)
    else:
        tl.store(k1p, k_lo, mask=kmask)
        tl.store(k1p + HALF, k_hi, mask=kmask)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    _launch_rope(q, k, positions, cos_sin_cache, None)
    return q, k


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """Rotates q in place; writes rotated k and v to k_cache/v_cache [num_slots, KVH, D] at `slots`
    (k itself is left unrotated). Returns q."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("apply_rope_and_store needs unit stride over head_dim for v and the caches")
    _launch_rope(q, k, positions, cos_sin_cache, (v, k_cache, v_cache, slots))
    return q


def _launch_rope(q, k, positions, cos_sin_cache, store) -> None:
    T, H, D = q.shape
    KVH = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rope needs unit stride over head_dim for q, k and the cache")
    if T == 0:
        return
    half = D // 2
    v, kc, vc, slots = store if store is not None else (k, k, k, positions)  # unused when STORE is off
    _rope_kernel[(T,)](q, k, positions, cos_sin_cache,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                       positions.stride(0), H, KVH,
                       v, kc, vc, slots, v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
                       vc.stride(0), vc.stride(1), slots.stride(0),
                       HALF=half, BLOCK_H=triton.next_power_of_2(max(H, KVH)),
                       BLOCK_D=triton.next_power_of_2(half), STORE=store is not None,
                       num_warps=1 if H * half <= 1024 else 4)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * x_stride + I + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * out_stride + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty(x2.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = min(1024, triton.next_power_of_2(I))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, BLOCK))](x2, out, x2.stride(0), out.stride(0), I,
                                                                   BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], I)


@triton.jit
def _mask_logits_kernel(logits_ptr, mask_ptr, out_ptr, logits_stride, mask_stride, out_stride, V, W,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    words = cols >> 5
    # Each column loads its own word: 32 neighbours share it, so that is one cached line, not 32 reads.
    word = tl.load(mask_ptr + row * mask_stride + words, mask=in_vocab & (words < W), other=0)
    allowed = ((word >> (cols & 31)) & 1) != 0
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_vocab)
    tl.store(out_ptr + row * out_stride + cols, tl.where(allowed, x, float("-inf")), mask=in_vocab)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("mask_logits needs unit stride over the vocab and the bitmask words")
    out = torch.empty((B, V), dtype=logits.dtype, device=logits.device)
    BLOCK = min(2048, triton.next_power_of_2(V))
    if B > 0:
        _mask_logits_kernel[(B, triton.cdiv(V, BLOCK))](logits, bitmask, out, logits.stride(0), bitmask.stride(0),
                                                        out.stride(0), V, bitmask.shape[1], BLOCK=BLOCK,
                                                        num_warps=4)
    return out


# -- top-k log-probabilities (the EAGLE draft tail) ------------------------------------------------
# Two launches instead of torch's ~25 (log_softmax, NaN cleanup, the path score, and a radix top-k
# that splits a 49k-token row over 5+ kernels): each (row, chunk) program keeps its chunk's max,
# sum of exponentials and top-k; one program per row merges its chunks.

@triton.jit
def select_topk(x, idx, K: tl.constexpr, BIG: tl.constexpr):
    """The K largest of x (ties: the lowest idx first; -inf entries only after every finite one,
    each index at most once), as two [K] vectors (values, indices)."""
    ks = tl.arange(0, K)
    vals = tl.full((K,), float("-inf"), tl.float32)
    ids = tl.zeros((K,), tl.int64)
    taken = idx < 0  # all False
    for j in tl.static_range(K):
        m = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        pick = tl.min(tl.where((x == m) & ~taken, idx, BIG), axis=0)
        taken = taken | (idx == pick)
        vals = tl.where(ks == j, m, vals)
        ids = tl.where(ks == j, pick, ids)
    return vals, ids


@triton.jit
def _topk_chunk_kernel(logits_ptr, mask_ptr, m_ptr, s_ptr, v_ptr, i_ptr, logits_stride, mask_stride, V, W, C,
                       HAS_MASK: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = cols >> 5
        word = tl.load(mask_ptr + row * mask_stride + words, mask=in_vocab & (words < W), other=0)
        x = tl.where(((word >> (cols & 31)) & 1) != 0, x, float("-inf"))
    x = tl.where(x != x, float("-inf"), x)  # NaN
    m = tl.max(x, axis=0)
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - safe_m), axis=0)
    vals, ids = select_topk(x, cols.to(tl.int64), K, 1 << 40)
    out = row * C + chunk
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    ks = tl.arange(0, K)
    tl.store(v_ptr + out * K + ks, vals)
    tl.store(i_ptr + out * K + ks, ids)


@triton.jit
def _topk_merge_kernel(m_ptr, s_ptr, v_ptr, i_ptr, base_ptr, score_ptr, tok_ptr, C,
                       HAS_BASE: tl.constexpr, K: tl.constexpr, CBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, CBLOCK)
    live = cs < C
    m = tl.load(m_ptr + row * C + cs, mask=live, other=float("-inf"))
    s = tl.load(s_ptr + row * C + cs, mask=live, other=0.0)
    top = tl.max(m, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    lse = safe_top + tl.log(tl.sum(s * tl.exp(m - safe_top), axis=0))  # -inf when every token is masked
    cand = tl.arange(0, CBLOCK * K)
    live_c = cand < C * K
    v = tl.load(v_ptr + row * C * K + cand, mask=live_c, other=float("-inf"))
    i = tl.load(i_ptr + row * C * K + cand, mask=live_c, other=1 << 40)
    vals, ids = select_topk(v, i, K, 1 << 41)
    score = vals - lse
    score = tl.where(score != score, float("-inf"), score)  # -inf - -inf
    if HAS_BASE:
        score = score + tl.load(base_ptr + row)
    ks = tl.arange(0, K)
    tl.store(score_ptr + row * K + ks, score)
    tl.store(tok_ptr + row * K + ks, ids)


def topk_logprobs(logits: torch.Tensor, k: int, bitmask: torch.Tensor | None,
                  base: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    R, V = logits.shape
    if logits.stride(-1) != 1 or (bitmask is not None and bitmask.stride(-1) != 1):
        raise ValueError("topk_logprobs needs unit stride over the vocab and the bitmask words")
    if k & (k - 1):
        raise ValueError(f"topk_logprobs: k must be a power of two (got {k})")
    dev = logits.device
    BLOCK = min(4096, triton.next_power_of_2(V))
    C = triton.cdiv(V, BLOCK)
    m = torch.empty((R, C), dtype=torch.float32, device=dev)
    s = torch.empty((R, C), dtype=torch.float32, device=dev)
    v = torch.empty((R, C, k), dtype=torch.float32, device=dev)
    i = torch.empty((R, C, k), dtype=torch.int64, device=dev)
    score = torch.empty((R, k), dtype=torch.float32, device=dev)
    tok = torch.empty((R, k), dtype=torch.int64, device=dev)
    if R == 0:
        return score, tok
    mask = bitmask if bitmask is not None else logits
    _topk_chunk_kernel[(R, C)](logits, mask, m, s, v, i, logits.stride(0), mask.stride(0) if bitmask is not None else 0,
                               V, bitmask.shape[1] if bitmask is not None else 0, C,
                               HAS_MASK=bitmask is not None, K=k, BLOCK=BLOCK, num_warps=8)
    _topk_merge_kernel[(R,)](m, s, v, i, base if base is not None else score, score, tok, C,
                             HAS_BASE=base is not None, K=k, CBLOCK=triton.next_power_of_2(C), num_warps=1)
    return score, tok
