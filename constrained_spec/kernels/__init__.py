"""Fused elementwise kernels for the decoder: RMSNorm, residual-add + RMSNorm, RoPE, SiLU-and-mul,
the grammar mask of the logits, and, for a few rows (decode, small verify batches), those norms and
SiLU-and-mul fused into the linear that follows them.

Each op dispatches to a Triton kernel for CUDA tensors (one launch per op) and to the exact torch
reference otherwise — the reference is the math the model used before fusion, so the CPU path is
bit-for-bit unchanged. Set CONSTRAINED_SPEC_TORCH_KERNELS=1 (before import) or call
`set_fused_kernels(False)` to force the torch reference on CUDA too (for A/B timing and debugging).

All ops are CUDA-graph capturable: no host syncs, outputs allocated with torch.empty or written in place.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import reference
from .reference import (add_rms_norm_ref, apply_rope_ref, build_cos_sin_cache, mask_logits_ref, rms_norm_ref,
                        silu_and_mul_ref)

try:  # triton is optional (CPU installs)
    from . import triton_ops as _tri
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken triton install
    _tri = None
    HAS_TRITON = False

_ENABLED = os.environ.get("CONSTRAINED_SPEC_TORCH_KERNELS", "0").lower() in ("", "0", "false", "no")


def set_fused_kernels(enabled: bool) -> None:
    """Globally enable/disable the Triton path (the torch reference is used when disabled)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def fused_kernels_enabled() -> bool:
    return _ENABLED and HAS_TRITON


def _use_triton(x: torch.Tensor) -> bool:
    return _ENABLED and HAS_TRITON and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), over the last dim."""
    if _use_triton(x):
        return _tri.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). On CUDA both are written in place: the normed
    output into `x`, the sum into `residual`."""
    if _use_triton(x):
        return _tri.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, KVH, D] (views with unit last stride are
    fine). cos_sin_cache: float32 [max_pos, D] = cat(cos, sin) of the D/2 frequencies. Returns (q, k)."""
    if _use_triton(q):
        return _tri.apply_rope(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """RoPE on q (in place) and k, then k and v written to the KV cache at `slots`: one kernel on
    CUDA instead of three. Returns q."""
    if _use_triton(q):
        return _tri.apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots)
    apply_rope_ref(q, k, positions, cos_sin_cache)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]."""
    if _use_triton(gate_up):
        return _tri.silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar mask, out of place: logits [B, V], bitmask [B, W] int32; bit t of row b's words,
    `(word >> (t & 31)) & 1`, allows token t, the others (and columns past 32 * W) become -inf.
    One launch on CUDA instead of the reference's ~9 small kernels (it sits in the graphed sample tail)."""
    if _use_triton(logits):
        return _tri.mask_logits(logits, bitmask)
    return mask_logits_ref(logits, bitmask)


# -- small-M fused linears ------------------------------------------------------------------------
# A decode step of a small model is bound by kernel launches, not bytes: fusing the norm (or
# SiLU-and-mul) into the next linear saves a launch per op, 3 a layer. The fused kernel streams the
# weight once with few programs, which only wins while the launch is what costs, so it is used for
# at most FUSED_LINEAR_MAX_ROWS rows (decode at batch <= 16, the 8-node verify at batch <= 2) and
# weights of at most FUSED_LINEAR_MAX_WEIGHT elements (SmolLM2-135M's largest is 3072 x 576 = 1.8M;
# Llama-3-8B's linears, 4096 x 4096 = 16.8M and up, stay on cuBLAS: there the weight stream dominates
# and the saving is a few percent at best; `kernels.bench` times both per shape). Everything else,
# and CPU, runs the pre-fusion pair: the elementwise op (Triton or torch, as above), then F.linear.
# The decision reads only static properties (device, dtypes, shapes): graphs are captured per batch
# size and replay whatever was chosen at capture. CONSTRAINED_SPEC_FUSED_LINEAR=0 (or
# set_fused_linear(False)) turns just these off; CONSTRAINED_SPEC_FUSED_LINEAR_MAX_WEIGHT moves the cap.
# OFF by default: measured on the H100 (`python -m constrained_spec.kernels.bench 1 8`, random SmolLM2
# weights, graphed), the first block sizes made the decode forward slower, 1.338 vs 0.835 ms at batch
# 1: a fused kernel took about as long as the pair it replaced (qkv 7.5 vs 5.3 us, gate_up 12.7 vs
# 6.0, down 11.5 vs 6.7); the best of a block-size sweep only matched the pairs (5.0, 5.5, 10.0 us).
# CONSTRAINED_SPEC_FUSED_LINEAR=1 turns them on for experiments.

FUSED_LINEAR_MAX_ROWS = 16
FUSED_LINEAR_MAX_WEIGHT = int(os.environ.get("CONSTRAINED_SPEC_FUSED_LINEAR_MAX_WEIGHT", 4 << 20))
_FUSED_LINEAR = os.environ.get("CONSTRAINED_SPEC_FUSED_LINEAR", "0").lower() in ("1", "true", "yes")


def fused_linear_enabled() -> bool:
    return _FUSED_LINEAR


def set_fused_linear(enabled: bool) -> None:
    """Enable/disable just the small-M fused linears (the other fused kernels are unaffected), for A/B timing."""
    global _FUSED_LINEAR
    _FUSED_LINEAR = bool(enabled)


def use_fused_linear(a: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether `a` [..., K] times `weight` [N, K] takes the fused small-M kernel; `others` (residual,
    norm weight, bias) must share a's dtype."""
    if not (_FUSED_LINEAR and _use_triton(a)) or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    rows = a.numel() // max(a.shape[-1], 1)
    return (rows <= FUSED_LINEAR_MAX_ROWS and weight.numel() <= FUSED_LINEAR_MAX_WEIGHT
            and weight.stride(-1) == 1 and all(t is None or t.dtype == a.dtype for t in (weight, *others)))


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(rms_norm(x, norm_weight, eps), weight, bias)."""
    if use_fused_linear(x, weight, norm_weight, bias):
        return _tri.rms_norm_linear(x, norm_weight, eps, weight, bias)
    return F.linear(rms_norm(x, norm_weight, eps), weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight, bias), x + residual). The fused kernel leaves x and
    residual untouched and returns the sum in a new tensor; the unfused path may write in place
    (see add_rms_norm), so callers must not reuse x or residual."""
    if use_fused_linear(x, weight, residual, norm_weight, bias):
        return _tri.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    h, residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) for gate_up = [..., 2I] (the gate_up projection's output)."""
    if use_fused_linear(gate_up, weight):
        return _tri.silu_mul_linear(gate_up, weight)
    return F.linear(silu_and_mul(gate_up), weight)


__all__ = ["FUSED_LINEAR_MAX_ROWS", "FUSED_LINEAR_MAX_WEIGHT", "HAS_TRITON", "add_rms_norm", "add_rms_norm_linear",
           "apply_rope", "apply_rope_and_store", "build_cos_sin_cache", "fused_kernels_enabled", "mask_logits",
           "reference", "rms_norm", "rms_norm_linear", "set_fused_kernels", "fused_linear_enabled", "set_fused_linear", "silu_and_mul",
           "silu_mul_linear", "use_fused_linear"]
