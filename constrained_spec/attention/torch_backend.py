"""Reference attention in plain torch: pads the batch, gathers each context from the slot pool,
and calls SDPA with an explicit mask. Runs on CPU and GPU; the other backends are tested against it.

bfloat16 on the CPU takes native kernels (`kernels.cpu_native`): RoPE + KV store, and the
attention of every step (one call reading the cache where it lies instead of two gathers, SDPA and
its reshapes: ~15 small ops per layer). Its per-token core gives a token the same bits whether it
is decoded, prefilled in any batch or chunk, or verified as a draft: bfloat16 greedy text does not
depend on batching, chunking or speculation. `kernels.set_fused_kernels(False)` makes
this plain torch again."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_native, uses_native_cpu_kernels
from ..kernels.reference import rope_cos_sin_ref, rotate_ref
from .base import AttentionBackend, AttentionMetadata, ForwardMode, KVCache


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, layer, kv: KVCache, meta: AttentionMetadata, scale, rope=None):
        if rope is not None and not q.is_cuda and not uses_native_cpu_kernels(q):
            q = _rope_and_store_cpu(q, k, v, layer, kv, meta, rope)
        else:  # one fused kernel on CUDA, and for bfloat16 on the CPU
            q = self.store_kv(q, k, v, layer, kv, meta, rope)
        T, H, D = q.shape
        B, Q, K = meta.batch_size, meta.max_q_len, meta.max_kv_len
        one_per_seq = Q == 1 and T == B  # decode: the flat tokens are the batch, no padding to undo
        if one_per_seq and uses_native_cpu_kernels(q):
            return cpu_native.decode_attention(q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, scale)
        if uses_native_cpu_kernels(q):  # prefill and verify: each token's bits as decoding it would get
            tree = meta.tree_mask if meta.mode is ForwardMode.VERIFY else None
            return cpu_native.tree_attention(q, kv.k[layer], kv.v[layer], meta.slot_table, meta.q_starts,
                                             meta.q_lens, meta.kv_lens, tree, scale)
        if "torch" not in meta.scratch:  # the same for every layer of this forward
            meta.scratch["torch"] = (*_token_coords(meta, T), _attention_mask(meta, Q, K, q.device).unsqueeze(1))
        token_batch, token_pos, mask = meta.scratch["torch"]

        if one_per_seq:
            qp = q.view(B, 1, H, D)
        else:
            qp = q.new_zeros(B, Q, H, D)
            qp[token_batch, token_pos] = q
        # index_select on whole slot rows: several times faster on CPU than advanced indexing
        slots = meta.slot_table[:, :K].reshape(-1)
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        KVH = k_cache.shape[1]
        kp = k_cache.index_select(0, slots).view(B, K, KVH, D)
        vp = v_cache.index_select(0, slots).view(B, K, KVH, D)

        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=True,
        ).transpose(1, 2)  # [B, Q, H, D]
        return out.reshape(T, H, D) if one_per_seq else out[token_batch, token_pos]


def _token_coords(meta: AttentionMetadata, T: int):
    """(sequence index, index within the sequence's new tokens) of every flat token."""
    B = meta.batch_size
    token_batch = torch.repeat_interleave(
        torch.arange(B, device=meta.q_lens.device), meta.q_lens.long(), output_size=T)
    token_pos = torch.arange(T, device=meta.q_lens.device) - meta.q_starts[:-1].long()[token_batch]
    return token_batch, token_pos


def _attention_mask(meta: AttentionMetadata, Q: int, K: int, device) -> torch.Tensor:
    prefix = (meta.kv_lens - meta.q_lens).long().view(-1, 1, 1)  # cached context before the new tokens
    qi = torch.arange(Q, device=device).view(1, Q, 1)
    kj = torch.arange(K, device=device).view(1, 1, K)
    in_query = qi < meta.q_lens.long().view(-1, 1, 1)
    in_context = kj < meta.kv_lens.long().view(-1, 1, 1)
    if meta.mode is ForwardMode.VERIFY and meta.tree_mask is not None:
        rel = (kj - prefix).clamp(min=0, max=Q - 1).expand(meta.batch_size, Q, K)
        tree = torch.gather(meta.tree_mask, 2, rel)
        visible = (kj < prefix) | tree
    else:
        visible = kj <= prefix + qi
    mask = visible & in_context & in_query
    # Padding query rows see nothing; give them one key so softmax stays finite.
    mask[..., 0] |= ~in_query[..., 0]
    return mask


def _rope_and_store_cpu(q, k, v, layer: int, kv: KVCache, meta: AttentionMetadata, rope) -> torch.Tensor:
    """`store_kv` on CPU in torch ops (float32, or the reference kernels forced), with the rotation's
    cos/sin gathered, widened and cast once per forward instead of in every layer (6 of its ~16
    small ops; a decode step on CPU is mostly small ops besides the GEMMs). The arithmetic is
    `kernels.reference.apply_rope_ref`'s, bit for bit."""
    key = ("torch_rope", q.dtype)
    if key not in meta.scratch:  # positions are the same in every layer of this forward
        meta.scratch[key] = rope_cos_sin_ref(*rope, q.dtype)
    rotate_ref(q, k, *meta.scratch[key])
    kv.store(layer, meta.out_slots, k, v)
    return q
