"""The EAGLE draft head: one decoder layer that predicts the target's next hidden state.

Input at position i: the target's hidden state f_i (last layer, before the final norm) and the
embedding of the token at i + 1; ``fc`` maps their concatenation back to the hidden size, one decoder
layer of the target's shape (its own attention over the head's earlier positions) follows, and its
output is the head's guess of f_{i+1}. The target's final norm and LM head, shared and frozen, turn
a guess into the distribution of the token at i + 2 (EAGLE, Li et al. 2024). The head owns only
``fc`` and the layer: ~4 M parameters for SmolLM2-135M.

Two forwards with the same math:
  * ``forward``: serving, over a paged KV cache of its own (one layer) through an attention backend,
    like the target's layers;
  * ``sequence_forward``: training, on padded [B, L] sequences in plain differentiable torch.

Saved as a folder: ``model.safetensors`` (fc.*, layer.*) and ``config.json`` (the target's shapes it
fits, how it was made).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import rms_norm_ref, rope_cos_sin_ref, silu_and_mul_ref
from .config import ModelConfig
from .llama import CausalLM, DecoderLayer

__all__ = ["EagleHead", "HeadMismatch", "default_head_dir", "load_head", "save_head"]

# the shapes a head must share with its target (config.json "target")
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
               "head_dim", "qkv_bias")
HEADS_DIR = Path(__file__).resolve().parent / "heads"
# the shipped head of each model the registry fetches by name
DEFAULT_HEADS = {"smollm2-135m": "smollm2-135m-eagle"}


# how the files of those models are named (a GGUF, or the folder it is converted to)
MODEL_FILE_PREFIX = {"smollm2-135m": "smollm2-135m-instruct"}


class HeadMismatch(ValueError):
    """The head was trained for a target of other shapes, or there is no head for this model."""


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(cfg, 0)  # layer 0 of the head's own one-layer KV cache

    def forward(self, target: CausalLM, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                kv, meta, backend) -> torch.Tensor:
        """features [T, H] (f_i), input_ids [T] (token i + 1), positions [T] (i). Writes the head's
        K/V at `meta.out_slots` of `kv`; returns its guesses of f_{i+1}, [T, H]."""
        x = self.fc(torch.cat([target.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], -1))
        x, residual = self.layer(x, None, positions, target.rope, kv, meta, backend)
        return x + residual

    @staticmethod
    def logits(target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (float32) of hidden states through the target's final norm and LM head."""
        return target.compute_logits(target.norm(hidden)).float()

    # -- training --------------------------------------------------------------------------------
    def sequence_forward(self, target: CausalLM, features: torch.Tensor, input_ids: torch.Tensor,
                         lengths: torch.Tensor | None = None) -> torch.Tensor:
        """features [B, L, H], input_ids [B, L] (the token after each feature's position), positions
        0..L-1, causal attention (keys past `lengths[b]` masked). Differentiable; [B, L, H]."""
        B, L, _ = features.shape
        cfg, layer = self.config, self.layer
        attn = layer.self_attn
        x = self.fc(torch.cat([target.embed_tokens(input_ids).to(features.dtype), features], -1))
        residual = x
        h = rms_norm_ref(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q = q.reshape(B * L, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B * L, cfg.num_kv_heads, cfg.head_dim)
        positions = torch.arange(L, device=x.device).repeat(B)
        cos, sin = rope_cos_sin_ref(positions, target.rope.cos_sin_cache, q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q = q.view(B, L, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(B, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(B, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, None]
        if lengths is not None:
            mask = mask & (torch.arange(L, device=x.device)[None, :] < lengths[:, None])[:, None, None, :]
            mask = mask | torch.eye(L, dtype=torch.bool, device=x.device)  # padded rows stay finite
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=True)
        x = attn.o_proj(out.transpose(1, 2).reshape(B, L, attn.q_size))
        residual = residual + x
        h = rms_norm_ref(residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        return layer.mlp.down_proj(silu_and_mul_ref(layer.mlp.gate_up_proj(h))) + residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def init_head(head: EagleHead, target: CausalLM, seed: int = 0) -> EagleHead:
    """A fresh head that starts as a copy of the target's last layer, with fc passing the feature
    through (EAGLE starts from random weights; starting from the last layer trains faster on a
    small budget)."""
    torch.manual_seed(seed)
    h = head.config.hidden_size
    with torch.no_grad():
        head.layer.load_state_dict(target.layers[-1].state_dict())
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.weight[:, :h].normal_(0.0, 0.02)
        head.fc.bias.zero_()
    return head


def _target_shapes(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in _SHAPE_KEYS}


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, info: dict | None = None) -> Path:
    """Writes model.safetensors (in `dtype`) and config.json; `info` says how the head was made."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architecture": "eagle", "target": _target_shapes(head.config), "info": info or {}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_head(path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype, device) -> EagleHead:
    """The head in folder `path`, checked against the target's shapes."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / "model.safetensors").is_file():
        raise HeadMismatch(f"no EAGLE head in {path} (expected config.json and model.safetensors); "
                           f"make one with `constrained-spec train-eagle --model M --out {path}`")
    saved = json.loads(cfg_file.read_text())
    want = _target_shapes(target_cfg)
    got = saved.get("target", {})
    diff = {k: (got.get(k), want[k]) for k in _SHAPE_KEYS if got.get(k) != want[k]}
    if diff:
        raise HeadMismatch(f"the EAGLE head in {path} was trained for another model: "
                           + ", ".join(f"{k} {a} != {b}" for k, (a, b) in diff.items()))
    head = EagleHead(target_cfg)
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_head_dir(model: str | None) -> Path:
    """The head shipped for `model`: a registry alias (None = the default model), or a file or folder
    of the same model (its GGUF, or the folder it was converted to)."""
    from .registry import lookup_alias
    spec = lookup_alias(model)
    alias = spec.alias if spec is not None else next(
        (a for a in DEFAULT_HEADS if Path(model).name.lower().startswith(MODEL_FILE_PREFIX[a])), None)
    name = DEFAULT_HEADS.get(alias)
    if name is None:
        raise HeadMismatch(f"no EAGLE head ships for model {model!r}; train one with "
                           f"`constrained-spec train-eagle --model {model} --out DIR` and pass --eagle-head DIR")
    return HEADS_DIR / name
