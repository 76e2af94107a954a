"""Triton kernels for the slot-pool (page size 1) KV cache: paged flash-decoding and extend/verify."""
from .decode import decode_attention
from .extend import extend_attention

__all__ = ["decode_attention", "extend_attention"]
