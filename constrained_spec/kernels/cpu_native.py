"""Fused bfloat16 kernels for the CPU forward (C++: native/cpu_kernels.h), with the checks the C++
side leaves to its caller.

Why: with its projections on oneDNN's prepacked weights (models/cpu_linear.py), a bfloat16 decode
step of SmolLM2-135M at batch 8 on the 2-core dev VM still spent ~12 of its ~25 ms outside the
GEMMs, in ~1,300 small torch ops (~400 us per layer): RMSNorm's eight ops, RoPE's dozen, the KV
store, SiLU-and-mul's three, the decode attention's gathers, mask and reshapes around SDPA, each a
dispatch and an allocation for a few thousand elements. Each function here is one call over the
raw buffers instead.

The elementwise ones give the torch references' (kernels/reference.py) results bit for bit: the
same float32 math, rounded to bfloat16 where the reference stores bfloat16, and the norm's mean
summed in the order torch's sum kernel adds (tests/test_cpu_kernels.py checks all of it, and SiLU
on every bfloat16 value). That order depends on the width of the vectors torch sums with
(`SUM_LANES`); where it is not the one assumed here, a mean may differ in its last float bit, and
rarely a normed element by one bfloat16 ulp (enough to change a greedy token after a few dozen).
Decode attention is as close to exact attention as SDPA is, but not SDPA's bits.

Inputs are checked here (device, dtype, shape, layout) because the C++ side only gets pointers.
"""
from __future__ import annotations

import torch

try:
    from .._native import cpu_kernels as _K
except (ImportError, AttributeError):  # an extension built before the kernels existed
    _K = None


def available() -> bool:
    return _K is not None


# The float lanes of torch's sum kernel on x86: 8 whatever the capability, since its AVX512 build is
# not registered (torch dispatches sum to its AVX2 kernel; the generic one is 32 bytes wide too).
SUM_LANES = 8


def _check_bf16(t: torch.Tensor, name: str) -> None:
    if t.dtype is not torch.bfloat16 or not t.is_cpu:
        raise ValueError(f"{name} must be a bfloat16 CPU tensor, got {t.dtype} on {t.device}")


def _check_contiguous_bf16(t: torch.Tensor, name: str) -> None:
    _check_bf16(t, name)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_contiguous_bf16(x, "x")
    _check_contiguous_bf16(weight, "weight")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm_ref` for bfloat16 x and weight (contiguous), into a new tensor."""
    _check_norm(x, weight)
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    width = x.shape[-1]
    _K.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps,
                     SUM_LANES)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_rms_norm_ref` in place: the sum into `residual`, its norm into `x`; returns
    (x, residual)."""
    _check_norm(x, weight)
    _check_contiguous_bf16(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    if x.numel() == 0:
        return x, residual
    width = x.shape[-1]
    _K.add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // width, width,
                         eps, SUM_LANES)
    return x, residual


def _check_heads(t: torch.Tensor, name: str, tokens: int, head_dim: int) -> None:
    """[tokens, heads, head_dim] with each token's heads contiguous (a row of a fused qkv output is)."""
    _check_bf16(t, name)
    if t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != head_dim:
        raise ValueError(f"{name} must be [{tokens}, heads, {head_dim}], got {tuple(t.shape)}")
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != head_dim):
        raise ValueError(f"{name}'s heads must be contiguous within a token (strides {t.stride()})")


def _check_index(t: torch.Tensor, name: str, tokens: int) -> torch.Tensor:
    if t.dtype is not torch.int64 or not t.is_cpu or t.shape != (tokens,):
        raise ValueError(f"{name} must be an int64 CPU tensor of shape ({tokens},), got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t.contiguous()


def _check_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                ) -> torch.Tensor:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    tokens, _, head_dim = q.shape
    _check_heads(q, "q", tokens, head_dim)
    _check_heads(k, "k", tokens, head_dim)
    if head_dim % 2 or head_dim > 512:
        raise ValueError(f"head_dim must be even and at most 512, got {head_dim}")
    if (cos_sin_cache.dtype is not torch.float32 or not cos_sin_cache.is_cpu or cos_sin_cache.dim() != 2
            or cos_sin_cache.shape[1] != head_dim or not cos_sin_cache.is_contiguous()):
        raise ValueError(f"cos_sin_cache must be a contiguous float32 CPU tensor [max_position, {head_dim}], got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    return _check_index(positions, "positions", tokens)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.apply_rope_ref`: q and k rotated in place. Returns (q, k)."""
    positions = _check_rope(q, k, positions, cos_sin_cache)
    if q.numel() == 0:
        return q, k
    _K.rope_bf16(q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.data_ptr(), q.stride(0), k.data_ptr(),
                 k.stride(0), positions=positions.data_ptr(), cos_sin_cache=cos_sin_cache.data_ptr(),
                 max_position=cos_sin_cache.shape[0])
    return q, k


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """q rotated in place; the rotated k and v written to rows `slots` of k_cache / v_cache
    [num_slots, kv_heads, head_dim] (k itself is left as it is). Returns q."""
    positions = _check_rope(q, k, positions, cos_sin_cache)
    tokens, kv_heads, head_dim = k.shape
    _check_heads(v, "v", tokens, head_dim)
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} and k {tuple(k.shape)} differ in shape")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_contiguous_bf16(cache, name)
        if cache.dim() != 3 or cache.shape[1:] != k.shape[1:]:
            raise ValueError(f"{name} must be [num_slots, {kv_heads}, {head_dim}], got {tuple(cache.shape)}")
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(f"k_cache and v_cache differ in slots: {k_cache.shape[0]} and {v_cache.shape[0]}")
    slots = _check_index(slots, "slots", tokens)
    if q.numel() == 0:
        return q
    _K.rope_bf16(tokens, q.shape[1], kv_heads, head_dim, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                 v.data_ptr(), v.stride(0), positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
                 k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0])
    return q


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, head_dim: int) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_contiguous_bf16(cache, name)
        if cache.dim() != 3 or cache.shape[2] != head_dim or cache.shape != k_cache.shape:
            raise ValueError(f"{name} must be [num_slots, kv_heads, {head_dim}] like k_cache, got {tuple(cache.shape)}")
    if heads % k_cache.shape[1]:
        raise ValueError(f"{heads} query heads do not share {k_cache.shape[1]} kv heads evenly")


def _check_table(slot_table: torch.Tensor, batch: int) -> None:
    if (slot_table.dtype is not torch.int64 or not slot_table.is_cpu or slot_table.dim() != 2
            or slot_table.shape[0] != batch or slot_table.stride(1) != 1):
        raise ValueError(f"slot_table must be an int64 CPU tensor [{batch}, width] with contiguous rows, got "
                         f"{slot_table.dtype} {tuple(slot_table.shape)} strides {slot_table.stride()}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], against its context: the first kv_lens[b] slots
    of slot_table[b] in k_cache / v_cache [num_slots, KVH, D] (H a multiple of KVH). Returns
    [B, H, D]. Close to SDPA's output, not bit for bit (native/cpu_kernels.h says why)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got {tuple(q.shape)}")
    batch, heads, head_dim = q.shape
    _check_heads(q, "q", batch, head_dim)
    _check_caches(k_cache, v_cache, heads, head_dim)
    _check_table(slot_table, batch)
    if kv_lens.dtype is not torch.int32 or not kv_lens.is_cpu or kv_lens.shape != (batch,):
        raise ValueError(f"kv_lens must be an int32 CPU tensor of shape ({batch},), got {kv_lens.dtype} "
                         f"{tuple(kv_lens.shape)}")
    kv_lens = kv_lens.contiguous()
    out = q.new_empty(batch, heads, head_dim)
    if batch == 0:
        return out
    _K.decode_attention_bf16(batch, heads, k_cache.shape[1], head_dim, q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), k_cache.shape[0], slot_table.data_ptr(), slot_table.shape[1],
                             slot_table.stride(0), kv_lens.data_ptr(), scale, out.data_ptr())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul_ref`: [..., 2I] -> silu(gate) * up, [..., I]."""
    _check_contiguous_bf16(gate_up, "gate_up")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even, got shape {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    if out.numel() == 0:
        return out
    _K.silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter)
    return out


# -- AMX projections (native/amx_linear.h) ------------------------------------------------------

_AMX_TILE_K = 32  # the kernel reads x 32 columns at a time


def _amx_packed_size(n: int, k: int) -> int:
    """`amx_packed_size` without a native call (the hot path checks it on every projection)."""
    return -(-n // 16) * 16 * (k + k % 2)


def amx_linear_available() -> bool:
    """The native module is built with the AMX kernel, and this CPU and OS run it."""
    return _K is not None and hasattr(_K, "amx_linear_supported") and _K.amx_linear_supported()


def amx_linear_fits(weight: torch.Tensor) -> bool:
    """`weight` can go through `amx_linear`: AMX here, a bfloat16 CPU matrix, in_features a multiple of 32."""
    return (amx_linear_available() and weight.dtype is torch.bfloat16 and weight.is_cpu and weight.dim() == 2
            and weight.shape[1] % _AMX_TILE_K == 0)


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] -> its packed form for `amx_linear` (a flat bfloat16 tensor)."""
    if not amx_linear_fits(weight):
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} on {weight.device} does not fit the AMX kernel")
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(_K.amx_packed_size(n, k), dtype=torch.bfloat16)
    _K.amx_pack_weight_bf16(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [rows, k] @ weight.T + bias -> [rows, out_features], `packed` from `amx_pack`; out_dtype
    bfloat16 (rounded once) or float32 (the float32 sum as it is). The hot path of every CPU
    bfloat16 projection: checks only what a wrong call would corrupt memory with."""
    k = x.shape[1]
    if x.dtype is not torch.bfloat16 or x.stride(1) != 1 or packed.numel() != _amx_packed_size(out_features, k):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} strides {x.stride()} does not match a packed "
                         f"[{out_features}, {k}] bfloat16 weight")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, not {out_dtype}")
    out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
    if x.shape[0]:
        _K.amx_linear_bf16(x.data_ptr(), x.shape[0], k, x.stride(0), packed.data_ptr(), out_features,
                           0 if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                           out_dtype is torch.float32)
    return out


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                   q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                   tree_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Several new tokens per sequence, q [T, H, D] (sequence b's at rows q_starts[b] ..), each
    against its context and, of the new tokens, those tree_mask[b, i] marks (None: causal).
    Returns [T, H, D]; a token's output is bit for bit `decode_attention`'s over the same slots."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    tokens, heads, head_dim = q.shape
    batch = q_lens.shape[0]
    _check_heads(q, "q", tokens, head_dim)
    _check_caches(k_cache, v_cache, heads, head_dim)
    _check_table(slot_table, batch)
    for name, t, n in (("q_starts", q_starts, batch + 1), ("q_lens", q_lens, batch), ("kv_lens", kv_lens, batch)):
        if t.dtype is not torch.int32 or not t.is_cpu or t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 CPU tensor of shape ({n},), got {t.dtype} "
                             f"{tuple(t.shape)}")
    width = 0
    if tree_mask is not None:
        if (tree_mask.dtype is not torch.bool or tree_mask.dim() != 3 or tree_mask.shape[0] != batch
                or tree_mask.shape[1] != tree_mask.shape[2] or not tree_mask.is_contiguous()):
            raise ValueError(f"tree_mask must be a contiguous bool [{batch}, n, n] tensor, got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
        width = tree_mask.shape[1]
    out = q.new_empty(tokens, heads, head_dim)
    if tokens == 0:
        return out
    _K.tree_attention_bf16(batch, tokens, heads, k_cache.shape[1], head_dim, q.data_ptr(), q.stride(0),
                           k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], slot_table.data_ptr(),
                           slot_table.shape[1], slot_table.stride(0), q_starts.data_ptr(), q_lens.data_ptr(),
                           kv_lens.data_ptr(), 0 if tree_mask is None else tree_mask.data_ptr(), width, scale,
                           out.data_ptr())
    return out
