"""Rotary position embeddings with the scalings Llama-family configs use (default, linear, llama3)."""
from __future__ import annotations

import math

import torch


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
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        # [max_pos, head_dim]: cos|sin for the rotate-half layout HF checkpoints use
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1), persistent=False)
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)
