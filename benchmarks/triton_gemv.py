"""A candidate small-M GEMM (M <= 8) in Triton, for the batch-1 decode GEMMs that cuBLAS runs at 57-73%
of the copy bandwidth (the q/k/v and o shapes of Llama-3.1-8B: kernel-choices.json).

Each program owns BLOCK_N output features for every row and walks the whole K dimension, so a weight
element is read exactly once and no split-K reduction kernel follows. Rows are few, so the product is
formed on CUDA cores as a broadcast multiply and a sum over K, accumulated in float32.

This is a benchmark candidate (kernel_choices.py measures it against cuBLAS); the engine does not use
it. Correctness is checked on the CPU with Triton's interpreter (tests/unit/test_triton_gemv.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_M = 8


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,  # a weight's K is fixed: one compiled kernel per layer shape
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] for m < M (w row-major [N, K], K contiguous)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _m_pad(m: int) -> int:
    return max(1, triton.next_power_of_2(m))


def gemv(
    x: torch.Tensor, w: torch.Tensor, *, block_n: int = 16, block_k: int = 256, num_warps: int = 4
) -> torch.Tensor:
    """x [M, K] (M <= 8) times w [N, K] transposed: the same product as F.linear(x, w)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"gemv takes x [M <= {MAX_M}, K] and w [N, K], K contiguous; got {x.shape}, {w.shape}"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    launch: Any = gemv_kernel[grid]
    launch(
        x,
        w,
        y,
        m,
        n,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        K=k,
        M_PAD=_m_pad(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return y


# (BLOCK_N, BLOCK_K, num_warps): a small sweep; registers hold M_PAD x BLOCK_N x BLOCK_K products.
CONFIGS = [
    (4, 512, 4),
    (8, 256, 4),
    (8, 512, 4),
    (16, 256, 4),
    (16, 512, 8),
    (32, 256, 8),
    (32, 128, 4),
    (4, 256, 2),
    (16, 128, 8),
]
