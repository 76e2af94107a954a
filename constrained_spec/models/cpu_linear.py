"""bfloat16 projections on the CPU with oneDNN's prepacked weights.

A CPU decode step is its projection GEMMs (benchmarks/bench_cpu_gemm.py). For bfloat16 weights,
`F.linear` re-lays the weight out for oneDNN on every call; prepacking it once into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing
uses) and calling `torch.ops.mkldnn._linear_pointwise` took SmolLM2-135M's 121 matmuls per step
from 20.5 / 22.0 / 23.5 ms to 15.1 / 14.7 / 17.3 ms at 1 / 8 / 24 rows on the 2-core AMX dev VM,
with the same outputs bit for bit. float32 stays on `F.linear`: prepacked it is slower at one row
and not bit-exact with `transformers`.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def prepack_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight prepacked for oneDNN (CPU, inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's [tokens, features]: no reshapes (two small ops of each of its ~120 calls a step)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def prepack_bf16_linears(model: nn.Module) -> int:
    """Replaces every bfloat16 `nn.Linear` of a CPU model by a `PackedLinear`, and gives the model
    a packed logits head (`model.packed_head`, for `compute_logits`; a tied head keeps its
    embedding). Returns how many were packed (0 where oneDNN's ops are missing)."""
    if not prepack_available():
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is getattr(model, "lm_head", None):
                continue  # the head is packed below, its module left as it is (`head_weight` reads it)
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                packed += 1
    head = getattr(model, "head_weight", None)
    if packed and head is not None and head.dtype == torch.bfloat16 and getattr(model, "packed_head", None) is None:
        model.packed_head = PackedLinear(head, None)
    log.info("prepacked %d bfloat16 projections for oneDNN", packed)
    return packed
