"""The few architecture numbers our forward code needs, read from a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass, field


SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "mistral"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
        )
