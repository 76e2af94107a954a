"""bfloat16 projections on the CPU with prepacked weights: our AMX kernel where the CPU has AMX,
oneDNN's blocked layout elsewhere.

A CPU decode step is its projection GEMMs (benchmarks/bench_cpu_gemm.py): each weight streams
from memory once per step. `F.linear` re-lays a bfloat16 weight out for oneDNN on every call;
prepacking it once (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing
uses) took SmolLM2-135M's 121 matmuls per step from 20.5 / 22.0 / 23.5 ms to 15.1 / 14.7 / 17.3 ms
at 1 / 8 / 24 rows on the 2-core AMX dev VM, the same outputs bit for bit. Our AMX kernel
(native/amx_linear.h) streams the same weights at ~30 GB/s to oneDNN's ~20: 9.7 against 14.2 ms
for the step's 121 matmuls at 8 rows (results/cpu_gemm_floor.md). Both round a float32 sum once;
oneDNN's bits are the same for some shapes and not others (its kernels change with the row
count), while the AMX kernel's row does not depend on the batch around it.
float32 stays on `F.linear`: prepacked it is slower at one row and not bit-exact with
`transformers`.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import cpu_native

log = logging.getLogger(__name__)


def prepack_available() -> bool:
    """oneDNN's prepacking ops are in this torch build and its bfloat16 path runs on this CPU (it needs
    AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    supported = getattr(ops, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else True


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight prepacked (CPU, bfloat16, inference only): for the AMX kernel
    where `cpu_native.amx_linear_fits` it, for oneDNN otherwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, float32_out: bool = False,
                 amx: bool | None = None):
        """amx: None packs for AMX where it fits; False packs for oneDNN (A/B benchmarks)."""
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.amx = cpu_native.amx_linear_fits(weight) if amx is None else amx
        if self.amx and not cpu_native.amx_linear_fits(weight):
            raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} does not fit the AMX kernel")
        # float32 output (the AMX kernel's unrounded sum) for the logits head: bfloat16 logits tie
        # often, and a tie makes greedy and top-k=1 pick by index rather than by the model
        self.out_dtype = torch.float32 if float32_out and self.amx else torch.bfloat16
        if self.amx:
            self.packed = cpu_native.amx_pack(weight.detach())
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.amx:
            out = cpu_native.amx_linear(flat, self.packed, self.out_features, self.bias, self.out_dtype)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def prepack_bf16_linears(model: nn.Module) -> int:
    """Replaces every bfloat16 `nn.Linear` of a CPU model by a `PackedLinear`, and gives the model
    a packed logits head (`model.packed_head`, for `compute_logits`; a tied head keeps its
    embedding). Returns how many were packed (0 where neither AMX nor oneDNN's ops are there)."""
    onednn = prepack_available()
    if not (onednn or cpu_native.amx_linear_available()):
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is getattr(model, "lm_head", None):
                continue  # the head is packed below, its module left as it is (`head_weight` reads it)
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu" \
                    and (onednn or cpu_native.amx_linear_fits(child.weight)):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                packed += 1
    head = getattr(model, "head_weight", None)
    if packed and head is not None and head.dtype == torch.bfloat16 and getattr(model, "packed_head", None) is None \
            and (onednn or cpu_native.amx_linear_fits(head)):
        model.packed_head = PackedLinear(head, None, float32_out=True)
    kinds = {m.amx for m in model.modules() if isinstance(m, PackedLinear)}
    log.info("prepacked %d bfloat16 projections for %s", packed,
             " and ".join(k for k, used in (("AMX", True in kinds), ("oneDNN", False in kinds)) if used))
    return packed
