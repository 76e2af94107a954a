"""The attention-backend interface and the metadata every backend reads.

A forward pass works on a flat list of T new tokens belonging to B sequences. Each
sequence's keys/values live in a token-slot pool (page size 1): `slot_table[b, :kv_lens[b]]`
are the slots of its whole context, new tokens included (they are the last `q_lens[b]`).
The backend first writes the new tokens' K/V into `out_slots`, then attends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ..kernels import apply_rope_and_store


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, possibly over an already-cached prefix (chunked prefill)
    DECODE = "decode"  # exactly one new token per sequence
    VERIFY = "verify"  # draft tree per sequence; attention among new tokens follows `tree_mask`


@dataclass
class AttentionMetadata:
    mode: ForwardMode
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    q_starts: torch.Tensor  # [B+1] int32: cumulative new-token counts (cu_seqlens)
    q_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32: context length including the new tokens
    slot_table: torch.Tensor  # [B, max_kv_len] int64: slots of each sequence's context, padded
    max_q_len: int
    max_kv_len: int
    # VERIFY only: [B, max_q_len, max_q_len] bool, tree_mask[b, i, j] = node j is i or an ancestor
    # of i. Context tokens before the tree are always visible.
    tree_mask: torch.Tensor | None = None
    # per-forward scratch a backend derives once and reuses in every layer (e.g. the torch
    # backend's padded mask)
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]


class KVCache:
    """Per-layer K and V buffers indexed by token slot."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


class AttentionBackend:
    """Computes attention for one layer. Backends are stateless apart from scratch buffers."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                kv: KVCache, meta: AttentionMetadata, scale: float,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Stores k/v at `meta.out_slots` and
        returns the attention output [T, H, D]. `rope` = (positions [T], cos_sin_cache): rotate q and
        k first (a backend may fuse the rotation with the KV store)."""
        raise NotImplementedError

    @staticmethod
    def store_kv(q, k, v, layer: int, kv: KVCache, meta: AttentionMetadata, rope) -> torch.Tensor:
        """RoPE (when given) and the KV store, fused into one kernel on CUDA and for bfloat16 on the
        CPU. Returns q."""
        if rope is None:
            kv.store(layer, meta.out_slots, k, v)
            return q
        return apply_rope_and_store(q, k, v, rope[0], rope[1], kv.k[layer], kv.v[layer], meta.out_slots)
