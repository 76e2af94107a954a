"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen2/2.5 (qkv bias) over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each, and the elementwise work runs as one
kernel per op on CUDA (`constrained_spec.kernels`: residual-add + RMSNorm, RoPE on q and k,
SiLU-and-mul): fewer kernels per layer, which is what bounds a small model's decode step on a GPU.
The residual stream is carried beside the hidden states (vLLM/SGLang style), so each residual add
is fused into the next norm. On CPU, float32 runs the exact pre-fusion torch math and bfloat16 runs
native C++ kernels that give the same bits with one call per op instead of a chain of small ones
(`kernels/cpu_native.py`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
import torch.nn.functional as F

from ..attention.base import AttentionBackend, AttentionMetadata, KVCache
from ..kernels import add_rms_norm, rms_norm, silu_and_mul
from .config import ModelConfig
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: the normed x. With it: (norm(x + residual), x + residual); on CUDA
        and for bfloat16 on the CPU both are written in place into x and residual."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, positions, rope: RotaryEmbedding, kv: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # RoPE is applied by the backend, fused with the KV store on CUDA
        out = backend.forward(q, k, v, self.layer, kv, meta, self.scale, rope=(positions, rope.cos_sin_cache))
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rope, kv, meta, backend):
        """x: the previous layer's output (or the embeddings when residual is None), residual: the
        residual stream before it. Returns (this layer's MLP output, residual stream before it)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_head = None  # the head prepacked for oneDNN (bfloat16 on CPU: models/cpu_linear.py)
        # ids at or past this have no text (rows padding the head past the tokenizer's vocabulary):
        # their logits are -inf, so nothing samples, drafts or lists them (`models.load_model` sets it)
        self.text_vocab_size = cfg.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend, features: bool = False):
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden]; with `features`,
        (them, the last layer's output before the final norm): what an EAGLE head reads, free
        since the norm computes it anyway."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, kv, meta, backend)
        if residual is None:
            return (self.norm(x), x) if features else self.norm(x)
        normed, pre_norm = self.norm(x, residual)
        return (normed, pre_norm) if features else normed

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.packed_head(hidden) if self.packed_head is not None else F.linear(hidden, self.head_weight)
        if self.text_vocab_size < logits.shape[-1]:
            logits[..., self.text_vocab_size:] = float("-inf")
        return logits

    # -- weights ---------------------------------------------------------------------------------
    _FUSED = {  # HF name fragment -> (our fused parameter, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, offset, size = name, 0, None
            for hf, (ours, shard) in self._FUSED.items():
                if hf in name:
                    target = name.replace(hf, ours)
                    offset, size = self._shard_range(ours, shard)
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.model_type}")
            param = params[target]
            with torch.no_grad():
                dst = param if size is None else param.narrow(0, offset, size)
                if dst.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
                dst.copy_(tensor)
            loaded.add(f"{target}:{offset}")
        expected = sum(self._shard_count(n) for n in params)
        if len(loaded) != expected:
            raise ValueError(f"checkpoint is incomplete: loaded {len(loaded)} of {expected} weight tensors")

    def _shard_range(self, fused: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if fused.endswith("qkv_proj"):
            q, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, kvs), (q + kvs, kvs)][shard]
        return [(0, cfg.intermediate_size), (cfg.intermediate_size, cfg.intermediate_size)][shard]

    @staticmethod
    def _shard_count(param_name: str) -> int:
        return 3 if "qkv_proj" in param_name else 2 if "gate_up_proj" in param_name else 1
