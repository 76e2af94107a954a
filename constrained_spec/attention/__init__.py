"""Attention backends: `torch` (reference, CPU and GPU), `triton` (GPU default)."""
from __future__ import annotations

from .base import AttentionBackend, AttentionMetadata, ForwardMode, KVCache


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") and _has_triton() else "torch"
    if name == "torch":
        from .torch_backend import TorchAttention
        return TorchAttention()
    if name == "triton":
        if not str(device).startswith("cuda"):
            raise ValueError("the triton attention backend needs a CUDA device; use the torch one (attention_backend=\"torch\", --attention-backend torch)")
        from .triton_backend import TritonAttention
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose torch, triton or auto")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
        from . import triton_backend  # noqa: F401
        return True
    except ImportError:
        return False


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardMode", "KVCache", "get_attention_backend"]
