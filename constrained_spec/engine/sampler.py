"""Batched sampling on the device: logit biases, penalties, temperature, top-k, top-p, min-p, seeded draws.

Randomness is counter-based: the noise for (seed, step, token) is a hash of the three, so a
request samples the same tokens alone or in any batch, with no per-request generator objects and
no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row parameters as device tensors, built once per step by the runner."""
    temperature: torch.Tensor  # [B] float; 0 means greedy
    top_k: torch.Tensor  # [B] int64; vocab size means off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: output position, so each draw gets fresh noise
    frequency_penalty: torch.Tensor | None = None  # [B] float, None when no row uses penalties
    presence_penalty: torch.Tensor | None = None
    token_counts: torch.Tensor | None = None  # [B, V] counts of each token in the output so far
    # (rows, token ids, biases) of every row's logit_bias entries, None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    all_greedy: bool = False
    needs_filter: bool = False  # any row with top-k/top-p/min-p


def seed_word(seed: int) -> int:
    """A request's 64-bit seed as the 32 bits the noise hashes: the low word with the high word
    mixed in (the noise reads 32 bits, so seeds that differed only above them, as -1 and 2**63 - 1,
    drew the same tokens); a seed in [0, 2**32) is itself."""
    high = (seed >> 32) & _MASK32
    if high:  # hashed (lowbias32): a linear mix of the words let -1 and 2**32 + 1 meet
        for mul in (0x7FEB352D, 0x846CA68B):
            high ^= high >> 16
            high = (high * mul) & _MASK32
        high ^= high >> 16
    return (seed & _MASK32) ^ high


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) of shape [B, vocab], a pure function of (seed, step, token index)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    x = (seeds.unsqueeze(1) * 0x9E3779B1 + steps.unsqueeze(1) * 0x85EBCA77 + idx * 0xC2B2AE3D) & _MASK32
    for mul in (0x7FEB352D, 0x846CA68B):  # lowbias32 finalizer
        x = x ^ (x >> 16)
        x = (x * mul) & _MASK32
    x = x ^ (x >> 16)
    # 23 bits: (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1); with 32 bits the
    # top values round to 1.0, -log(u) becomes 0 and masked tokens would win with 0/0 = NaN.
    return ((x >> 9).to(torch.float32) + 0.5) / 8388608.0


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Logit biases, then frequency and presence penalties (a new tensor where any applies). A
    grammar-masked logit stays -inf whatever is added to it."""
    if sb.logit_bias is not None:
        rows, tokens, values = sb.logit_bias
        logits = logits.index_put((rows, tokens), values.to(logits.dtype), accumulate=True)
    if sb.token_counts is None:
        return logits
    counts = sb.token_counts.to(logits.dtype)
    logits = logits - sb.frequency_penalty.unsqueeze(1) * counts
    return logits - sb.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def filter_probs(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Zeroes tokens outside top-k / top-p / min-p; rows stay unnormalized."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    keep = rank < sb.top_k.unsqueeze(1)
    cum_before = sorted_p.cumsum(-1) - sorted_p
    # (a row without top-p keeps its tail: a float32 cumsum can pass 1.0 before the last tokens, and
    # a row beside a top-p request would then draw otherwise than alone)
    keep &= (cum_before < sb.top_p.unsqueeze(1)) | (sb.top_p >= 1.0).unsqueeze(1)
    keep &= sorted_p >= sb.min_p.unsqueeze(1) * sorted_p[:, :1]
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)


def target_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from (temperature and filters applied), float32."""
    temp = sb.temperature.clamp(min=1e-5).unsqueeze(1)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    return filter_probs(probs, sb) if sb.needs_filter else probs


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [B, V] (grammar mask already applied) -> token ids [B] int64, on the device."""
    logits = apply_penalties(logits, sb)
    greedy = logits.argmax(-1)
    if sb.all_greedy:
        return greedy
    probs = target_probs(logits, sb)
    # Exponential race: argmax p / E with E ~ Exp(1) draws from p exactly.
    race = probs / -torch.log(uniform_noise(sb.seeds, sb.steps, probs.shape[-1]))
    drawn = race.argmax(-1)
    return torch.where(sb.temperature <= 1e-5, greedy, drawn)
