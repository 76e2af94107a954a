"""A bfloat16 CPU forward step (decode, prefill, speculative verify) in one native call
(native/forward_step.h): the CPU counterpart of replaying a step's CUDA graph.

`CausalLM.forward` stays the definition. On the CPU in bfloat16 each of its ops is already one
native kernel, but the ~10 calls a layer through module dispatch and argument checks cost ~68 us
of Python a layer: 2 ms of a ~17 ms SmolLM2 step at batch 8 on the 2-core dev VM. This runs the
same kernels in the same order from C++, so the hidden states are the forward's bit for bit
(tests/test_native_forward.py); the checks run once per step here instead of once per layer.
It applies where every projection is AMX-packed (models/cpu_linear.py) and the model is the
Llama-family decoder of models/llama.py.
"""
from __future__ import annotations

import logging

import torch

from .. import kernels
from ..attention.base import AttentionMetadata, ForwardMode, KVCache
from ..kernels import cpu_native
from .cpu_linear import PackedLinear
from .llama import CausalLM

log = logging.getLogger(__name__)


class NativeForward:
    """Built once per model by `build`; called with a step's inputs (decode, prefill or verify),
    returns the final norm's output [tokens, hidden] like `CausalLM.forward`."""

    def __init__(self, model: CausalLM):
        cfg = model.config
        self.model = model
        rows = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            rows.append([layer.input_layernorm.weight.data_ptr(), attn.qkv_proj.packed.data_ptr(),
                         0 if bias is None else bias.data_ptr(), attn.o_proj.packed.data_ptr(),
                         layer.post_attention_layernorm.weight.data_ptr(), mlp.gate_up_proj.packed.data_ptr(),
                         mlp.down_proj.packed.data_ptr()])
        self.layer_table = torch.tensor(rows, dtype=torch.int64)  # kept alive with the weights it points at
        self.cos_sin_cache = model.rope.cos_sin_cache.contiguous()
        self.hidden, self.q_size = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.qkv_width = self.q_size + 2 * cfg.num_kv_heads * cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim ** -0.5
        self.spec = dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                         kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
                         eps=float(cfg.rms_norm_eps), sum_lanes=cpu_native.SUM_LANES,
                         layer_table=self.layer_table.data_ptr(), final_norm=model.norm.weight.data_ptr(),
                         cos_sin_cache=self.cos_sin_cache.data_ptr(), max_position=self.cos_sin_cache.shape[0])

    @classmethod
    def build(cls, model) -> "NativeForward | None":
        """The native step for `model`, or None where it does not apply (the reason is logged)."""
        reason = cls._unsupported(model)
        if reason:
            log.info("CPU forward stays in Python: %s", reason)
            return None
        return cls(model)

    @staticmethod
    def _unsupported(model) -> str | None:
        if not isinstance(model, CausalLM):
            return f"{type(model).__name__} is not the Llama-family decoder"
        if not hasattr(cpu_native._K, "forward_step_bf16"):
            return "the native module was built without forward_step_bf16"
        if model.embed_tokens.weight.dtype is not torch.bfloat16 or model.embed_tokens.weight.device.type != "cpu":
            return "not a bfloat16 CPU model"
        for layer in model.layers:
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            if not all(isinstance(p, PackedLinear) and p.amx for p in projections):
                return "not every projection is packed for AMX"
        if model.rope.cos_sin_cache.dtype is not torch.float32:
            return "the RoPE cache is not float32"
        return None

    def applies(self, meta: AttentionMetadata) -> bool:
        """Any step (decode, prefill, verify) with the native kernels switched on (`kernels.set_fused_kernels`)."""
        return kernels.uses_native_cpu_kernels(self.model.embed_tokens.weight)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        T = input_ids.shape[0]
        table = meta.slot_table
        _check_step(T, positions, meta, kv)
        x = self.model.embed_tokens(input_ids)
        empty = lambda width: torch.empty(T, width, dtype=torch.bfloat16)  # noqa: E731
        buffers = dict(x=x, residual=empty(self.hidden), qkv=empty(self.qkv_width), attn=empty(self.q_size),
                       gate_up=empty(2 * self.intermediate), act=empty(self.intermediate))
        batch = dict(batch=meta.batch_size, tokens=T, positions=positions.data_ptr(),
                     out_slots=meta.out_slots.data_ptr(),
                     slot_table=table.data_ptr(), table_width=table.shape[1], table_row_stride=table.stride(0),
                     kv_lens=meta.kv_lens.data_ptr(), k_cache=kv.k.data_ptr(), v_cache=kv.v.data_ptr(),
                     num_slots=kv.num_slots, scale=self.scale)
        if meta.mode is not ForwardMode.DECODE:  # several tokens a sequence: causal, or a draft tree's mask
            mask = meta.tree_mask if meta.mode is ForwardMode.VERIFY else None
            batch.update(q_starts=meta.q_starts.data_ptr(), q_lens=meta.q_lens.data_ptr(),
                         tree_mask=0 if mask is None else mask.data_ptr(),
                         mask_width=0 if mask is None else mask.shape[1])
        cpu_native._K.forward_step_bf16(self.spec, batch, {k: t.data_ptr() for k, t in buffers.items()})
        return x


def _check_step(T: int, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> None:
    """What the C++ side takes on trust: dtypes, shapes and layouts (it checks slot, position and
    length values)."""
    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"native forward step: {what}")
    B = meta.batch_size
    for name, t in (("positions", positions), ("out_slots", meta.out_slots)):
        need(t.dtype is torch.int64 and t.shape == (T,) and t.is_contiguous(), f"{name} must be int64 [{T}] contiguous")
    int32 = [("kv_lens", meta.kv_lens, B)]
    if meta.mode is not ForwardMode.DECODE:
        int32 += [("q_lens", meta.q_lens, B), ("q_starts", meta.q_starts, B + 1)]
        mask = meta.tree_mask if meta.mode is ForwardMode.VERIFY else None
        need(mask is None or (mask.dtype is torch.bool and mask.dim() == 3 and mask.shape[0] == B
                              and mask.shape[1] == mask.shape[2] and mask.is_contiguous()),
             f"tree_mask must be a contiguous bool [{B}, n, n] tensor")
    else:
        need(B == T, f"a decode step has one token per sequence ({T} tokens, {B} sequences)")
    for name, t, n in int32:
        need(t.dtype is torch.int32 and t.shape == (n,) and t.is_contiguous(), f"{name} must be int32 [{n}] contiguous")
    table = meta.slot_table
    need(table.dtype is torch.int64 and table.dim() == 2 and table.shape[0] == B and table.stride(1) == 1,
         f"slot_table must be int64 [{B}, width] with contiguous rows")
    need(kv.k.dtype is torch.bfloat16 and kv.k.is_contiguous() and kv.v.is_contiguous() and kv.k.shape == kv.v.shape,
         "the KV cache must be contiguous bfloat16")
