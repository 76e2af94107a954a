"""Torch references of the fused ops: exactly the math the model (and sampler) ran before fusion
(the CPU path)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """float32 [max_position, head_dim] = cat(cos(freqs), sin(freqs)), freqs = pos ⊗ inv_freq."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k; returns (q, k). Same arithmetic as the pre-fusion RotaryEmbedding:
    cos/sin (duplicated over both halves) cast to q.dtype, q * cos + rotate_half(q) * sin."""
    return rotate_ref(q, k, *rope_cos_sin_ref(positions, cos_sin_cache, q.dtype))


def rope_cos_sin_ref(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) `apply_rope_ref` rotates with, [T, 1, D] in `dtype`: the same in every layer
    of a forward, so a caller may build them once (`rotate_ref` then does the rest)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return torch.cat([cos, cos], -1).unsqueeze(1).to(dtype), torch.cat([sin, sin], -1).unsqueeze(1).to(dtype)


def rotate_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k with the (cos, sin) of `rope_cos_sin_ref`; returns (q, k)."""
    q.copy_(q * cos + _rotate_half(q) * sin)
    k.copy_(k * cos + _rotate_half(k) * sin)
    return q, k


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def mask_logits_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar mask, out of place: bit t of row b's int32 words, `(word >> (t & 31)) & 1`, allows
    token t; the others, and columns past the last word, become -inf."""
    vocab = logits.shape[-1]
    covered = min(vocab, 32 * bitmask.shape[-1])
    idx = torch.arange(covered, device=logits.device)
    allowed = (bitmask[:, idx >> 5] >> (idx & 31).to(torch.int32)) & 1
    if covered < vocab:
        allowed = F.pad(allowed, (0, vocab - covered))
    return logits.masked_fill(allowed == 0, float("-inf"))


def topk_logprobs_ref(logits: torch.Tensor, k: int, bitmask: torch.Tensor | None = None,
                      base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k of log_softmax(masked logits) + base, their tokens); a fully masked row scores -inf."""
    if bitmask is not None:
        logits = mask_logits_ref(logits, bitmask)
    scores = torch.log_softmax(logits.float(), -1)
    scores = torch.where(scores.isnan(), -torch.inf, scores)
    if base is not None:
        scores = scores + base[:, None]
    return scores.topk(k, -1)
