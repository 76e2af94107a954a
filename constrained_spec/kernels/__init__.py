"""Fused elementwise kernels for the decoder: RMSNorm, residual-add + RMSNorm, RoPE, SiLU-and-mul,
and the grammar mask of the logits.

Each op dispatches to a Triton kernel for CUDA tensors (one launch per op), to a native C++ kernel
for bfloat16 CPU tensors (`cpu_native`: one call instead of a chain of small torch ops, the same
bits), and to the exact torch reference otherwise — the reference is the math the model used
before fusion, so float32 on the CPU stays bit-for-bit what it was (and equal to `transformers`).
Set CONSTRAINED_SPEC_TORCH_KERNELS=1 (before import) or call `set_fused_kernels(False)` to force the
torch reference everywhere (for A/B timing and debugging).

All ops are CUDA-graph capturable: no host syncs, outputs allocated with torch.empty or written in place.
"""
from __future__ import annotations

import os

import torch

from . import cpu_native, reference
from .reference import (add_rms_norm_ref, apply_rope_ref, build_cos_sin_cache, mask_logits_ref, rms_norm_ref,
                        silu_and_mul_ref, topk_logprobs_ref)

try:  # triton is optional (CPU installs)
    from . import triton_ops as _tri
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken triton install
    _tri = None
    HAS_TRITON = False

_ENABLED = os.environ.get("CONSTRAINED_SPEC_TORCH_KERNELS", "0").lower() in ("", "0", "false", "no")


def set_fused_kernels(enabled: bool) -> None:
    """Globally enable/disable the Triton and native CPU paths (the torch reference is used when disabled)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def fused_kernels_enabled() -> bool:
    """Whether CUDA tensors go to the Triton kernels."""
    return _ENABLED and HAS_TRITON


def uses_triton(x: torch.Tensor) -> bool:
    """Whether work on `x` goes to a Triton kernel (fused kernels on, and `x` on CUDA)."""
    return _ENABLED and HAS_TRITON and x.is_cuda


_HAS_NATIVE_CPU = cpu_native.available()


def uses_native_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ops on `x` (and tensors like it) go to the native CPU kernels: bfloat16 CPU tensors."""
    return _ENABLED and _HAS_NATIVE_CPU and x.dtype is torch.bfloat16 and x.is_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), over the last dim."""
    if uses_triton(x):
        return _tri.rms_norm(x, weight, eps)
    if uses_native_cpu_kernels(x) and weight.dtype is torch.bfloat16:
        return cpu_native.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). On CUDA and in the native CPU kernel both are written
    in place: the normed output into `x`, the sum into `residual`."""
    if uses_triton(x):
        return _tri.add_rms_norm(x, residual, weight, eps)
    if uses_native_cpu_kernels(x) and weight.dtype is torch.bfloat16:
        return cpu_native.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, KVH, D] (views with unit last stride are
    fine). cos_sin_cache: float32 [max_pos, D] = cat(cos, sin) of the D/2 frequencies. Returns (q, k)."""
    if uses_triton(q):
        return _tri.apply_rope(q, k, positions, cos_sin_cache)
    if uses_native_cpu_kernels(q):
        return cpu_native.apply_rope(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """RoPE on q (in place) and k, then k and v written to the KV cache at `slots`: one kernel on
    CUDA and for bfloat16 on the CPU instead of three. Returns q."""
    if uses_triton(q):
        return _tri.apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots)
    if uses_native_cpu_kernels(q):
        return cpu_native.apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots)
    apply_rope_ref(q, k, positions, cos_sin_cache)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]."""
    if uses_triton(gate_up):
        return _tri.silu_and_mul(gate_up)
    if uses_native_cpu_kernels(gate_up):
        return cpu_native.silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar mask, out of place: logits [B, V], bitmask [B, W] int32; bit t of row b's words,
    `(word >> (t & 31)) & 1`, allows token t, the others (and columns past 32 * W) become -inf.
    One launch on CUDA instead of the reference's ~9 small kernels (it sits in the graphed sample tail)."""
    if uses_triton(logits):
        return _tri.mask_logits(logits, bitmask)
    return mask_logits_ref(logits, bitmask)


def topk_logprobs(logits: torch.Tensor, k: int, bitmask: torch.Tensor | None = None,
                  base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of `logits` [R, V] under the grammar `bitmask` [R, W]
    (as in `mask_logits`; None: no mask): (log-probabilities + `base` [R] (None: 0), tokens),
    [R, k] float32 and int64, best first. A row whose every token is masked scores -inf. Two
    launches on CUDA where k is a power of two (ties: the lower token first) instead of ~25 small kernels."""
    if uses_triton(logits) and not k & (k - 1):
        return _tri.topk_logprobs(logits, k, bitmask, base)
    return topk_logprobs_ref(logits, k, bitmask, base)


__all__ = ["HAS_TRITON", "add_rms_norm", "apply_rope", "apply_rope_and_store", "build_cos_sin_cache", "cpu_native",
           "fused_kernels_enabled", "mask_logits", "reference", "rms_norm", "set_fused_kernels", "silu_and_mul",
           "topk_logprobs", "uses_native_cpu_kernels", "uses_triton"]
