"""Rotary position embeddings with the scalings Llama-family configs use (default, linear, llama3)."""
from __future__ import annotations

import math

import torch

from ..kernels import apply_rope, build_cos_sin_cache


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3(inv, scaling).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, out)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        # float32 [max_pos, head_dim] = cat(cos, sin) over the head_dim/2 frequencies, for the
        # rotate-half layout HF checkpoints use
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(inv, max_position), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotates q [T, H, D] and k [T, KVH, D] in place (one fused kernel on CUDA); returns (q, k)."""
        return apply_rope(q, k, positions, self.cos_sin_cache)
