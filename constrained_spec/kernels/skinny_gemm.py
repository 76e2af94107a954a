"""y = x @ w.T (+ bias) for a few rows of x: the projections of a decode step at small batch.

On the H100 cuBLAS takes 3.6-4.1 us per projection of SmolLM2-135M at batch 1 (1-3.5 MB of weights,
which HBM streams in ~1 us), and its 120 projections are half of the step's device time
(results/kernels_per_step_s6.log). This kernel streams the weight once per call: each program owns
BLOCK_N output columns, reads their rows of `w` along K and multiplies all (padded) rows of x
against them. Rows past ROWS use cuBLAS. Accumulation in float32, output in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # beyond this cuBLAS's tiles are efficient


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
    x_rows = x_ptr + offs_m[:, None] * x_stride
    if USE_DOT:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [N, K]
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # products summed once after the loop: one cross-lane reduction per call
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * y_stride + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def rows_bucket(m: int) -> int:
    return max(1, triton.next_power_of_2(m))


def default_config(rows: int, n: int, k: int) -> tuple[int, int, bool, int]:
    """(BLOCK_N, BLOCK_K, USE_DOT, num_warps) for ROWS = `rows` (a power of two)."""
    use_dot = rows >= 16
    block_k = 128 if rows <= 4 else 64
    block_n = 16 if n >= 2048 else 8
    return block_n, block_k, use_dot, 4


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, bool, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit last stride), weight [N, K] contiguous -> [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_ROWS and weight.shape[1] == K and weight.stride(-1) == 1 and x.stride(-1) == 1
    rows = max(rows_bucket(M), 1)
    block_n, block_k, use_dot, num_warps = config or default_config(rows, N, K)
    if use_dot:
        rows = max(rows, 16)  # tl.dot's smallest tile
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    _skinny_gemm_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, HAS_BIAS=bias is not None,
        num_warps=num_warps)
    return y
