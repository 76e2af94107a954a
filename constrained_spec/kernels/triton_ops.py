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
