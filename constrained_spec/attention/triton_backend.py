"""Triton attention backend (GPU default): paged flash-decoding, extend over a cached prefix, and
tree verify, all reading K/V straight from the token-slot pool through `slot_table`.

CUDA graphs: DECODE launches depend only on (B, H, KVH, D, slot_table width, num_splits), EXTEND and
VERIFY launches only on (B, T, H, KVH, D, slot_table width); nothing is read from the device on the
host, so each can be captured once per shape and replayed with new `q_lens`/`kv_lens`/`slot_table`/
`tree_mask` contents.
Capture after one warm-up call (the first call compiles the kernels).
"""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionMetadata, ForwardMode, KVCache
from .triton_kernels import decode_attention, extend_attention
from ..kernels import fused_kernels_enabled
from .triton_kernels.decode import DEFAULT_TARGET_PROGRAMS, DecodeRope, default_num_splits


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, max_splits: int = 32, num_splits: int | None = None,
                 target_programs: int = DEFAULT_TARGET_PROGRAMS, fuse_rope: bool = True):
        """`num_splits` fixes the flash-decoding split count; by default it is chosen per launch
        from static shapes only (batch size, kv heads, slot-table width): about `target_programs`
        programs per launch, capped at `max_splits` splits (`default_num_splits`). `fuse_rope`:
        decode rotates q/k and stores the new K/V inside the attention kernel (one launch a layer
        fewer); off, a separate RoPE + store kernel runs first (as extend and verify always do)."""
        if target_programs < 1:
            raise ValueError(f"target_programs must be positive, not {target_programs}")
        self.max_splits = max_splits
        self.num_splits = num_splits
        self.target_programs = target_programs
        self.fuse_rope = fuse_rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                kv: KVCache, meta: AttentionMetadata, scale: float, rope=None) -> torch.Tensor:
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        if meta.mode is ForwardMode.DECODE:
            fused = None
            if rope is not None and self.fuse_rope and fused_kernels_enabled():  # RoPE + KV store inside the kernel
                fused = DecodeRope(k, v, rope[0], rope[1], meta.out_slots)
            else:
                q = self.store_kv(q, k, v, layer, kv, meta, rope)
            return decode_attention(q, k_cache, v_cache, meta.slot_table, meta.kv_lens, scale,
                                    num_splits=self.num_splits, max_splits=self.max_splits,
                                    target_programs=self.target_programs, rope=fused)
        q = self.store_kv(q, k, v, layer, kv, meta, rope)
        if q.stride(-1) != 1:
            q = q.contiguous()
        tree = meta.tree_mask if meta.mode is ForwardMode.VERIFY else None
        return extend_attention(q, k_cache, v_cache, meta.slot_table, meta.kv_lens, meta.q_starts,
                                meta.q_lens, scale, tree_mask=tree)


__all__ = ["TritonAttention", "default_num_splits"]
