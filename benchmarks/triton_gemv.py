"""A small-batch GEMM (M <= 8 rows) in Triton: a candidate for the decode steps at batch 1-8 that lost.

Why it was tried: at batch 1 a decode step is a chain of weight reads, and cuBLAS runs the q/k/v, o and
down projections of Llama-3.1-8B at 57-85% of the copy bandwidth on an H200. Here each program owns
BLOCK_N output features for every row and walks the whole K dimension, so each weight element is read
once and no split-K reduction follows; the product is a broadcast multiply and a sum over K on CUDA
cores, in float32.

What the H200 said (kernel-choices-triton-gemv.json, every block config of `SWEEP`): slower than
cuBLAS on every decode shape, at its best config 13.8 against 13.7 µs (o), 18.3 against 15.8 (q/k/v),
37.2 against 32.6 (down) at batch 1, and 3-5x slower at batch 8, where the [M, BLOCK_N, BLOCK_K]
product spills. So the engine keeps cuBLAS; this stays as the measured alternative.
Correctness is checked on the CPU with Triton's interpreter (tests/unit/test_triton_gemv.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

MAX_M = 8


@triton.jit
def gemv_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    w_ptr,
    b_ptr,
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
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
    HAS_BIAS: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for m < M (w row-major [N, K], K contiguous)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN:
            w = tl.load(w_ptrs).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
        else:
            mask_k = offs_k < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int

    def fits(self, m_pad: int) -> bool:
        """At most ~128 float32 products in flight per thread; more spills registers."""
        return m_pad * self.block_n * self.block_k <= 128 * 32 * self.num_warps


def m_pad(m: int) -> int:
    return max(1, int(triton.next_power_of_2(m)))


def pick_config(m: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """The widest BLOCK_N that still leaves ~8 programs per SM (enough loads in flight to cover the
    memory latency without a software pipeline), then the longest BLOCK_K the registers allow."""
    block_n = 1
    while block_n < 32 and -(-n // (2 * block_n)) >= 8 * sm_count:
        block_n *= 2
    num_warps = 4
    block_k = 1024
    while block_k > 64 and not GemvConfig(block_n, block_k, num_warps).fits(m_pad(m)):
        block_k //= 2
    return GemvConfig(block_n, min(block_k, int(triton.next_power_of_2(k))), num_warps)


def gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, config: GemvConfig
) -> torch.Tensor:
    """x [M, K] (M <= 8) times w [N, K] transposed (+ bias): the same product as F.linear(x, w, bias)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"gemv takes x [M <= {MAX_M}, K] and w [N, K], K contiguous; got {x.shape}, {w.shape}"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn, bk = config.block_n, config.block_k
    launch: Any = gemv_kernel[(triton.cdiv(n, bn),)]
    launch(
        x,
        w,
        bias if bias is not None else w,  # never read without HAS_BIAS
        y,
        m,
        n,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        K=k,
        M_PAD=m_pad(m),
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN=n % bn == 0 and k % bk == 0,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
    )
    return y


# The block configs gemm_variants.py sweeps against `pick_config`'s choice.
SWEEP = [
    GemvConfig(bn, bk, warps)
    for bn in (1, 2, 4, 8, 16, 32)
    for bk in (256, 512, 1024)
    for warps in (4, 8)
    if bn * bk <= 8192
]
