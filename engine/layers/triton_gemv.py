"""x W^T for a few rows in Triton, each program holding its whole slice of the weight, for one-row decode
graphs, where a GEMM's time is mostly ramp and wait rather than bytes.

Each program owns `BLOCK_N` output features and loads their whole [BLOCK_N, K] slice of the weight into
registers before anything else. The weight is a constant, so under programmatic dependent launch (pdl.py)
that load runs while the kernel before it still computes the input; after the wait only the input row (a
few KB from L2) and the dot products are left. cuBLAS and tinygemm stream the weight after the input is
ready, or only a few stages of it before.

The rows run one after another over the same registers, so the kernel pays off for one row and loses to
cuBLAS and tinygemm by 4 rows (kernel-choices-chain.json); `gemv_max_bs` sets where the engine uses it.

Float32 products and sums, one rounding per output (the bias added first): the same contract as the
library GEMMs, which it matches up to summation order. Triton ships with CUDA builds of torch; imported
only on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.layers.pdl import pdl_launch

# Weight elements one program holds: 32 KB of bf16, 64 registers a thread at 4 warps.
SLICE_ELEMENTS = 16384


@triton.jit
def gemv_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    stride_x,
    stride_out,
    ROWS: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_PAD)
    col_mask = cols < N
    k_mask = ks < K
    w_mask = col_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_mask, other=0.0)
    if BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if PDL:
        # Only the weight (a constant) is read before the wait, and nothing is written before it.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    w = w.to(tl.float32)
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        acc = tl.sum(w * x[None, :], axis=1)
        if BIAS:
            acc += bias
        tl.store(out_ptr + r * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def block_n(k: int) -> int:
    """Output features per program: as many as keep its weight slice within `SLICE_ELEMENTS`, at most 16."""
    return max(1, min(16, SLICE_ELEMENTS // int(triton.next_power_of_2(k))))


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight is one `gemv` takes: 16-bit, contiguous, and a whole padded row within one
    program's slice (K up to 16,384)."""
    return (
        weight.dim() == 2
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
        and triton.next_power_of_2(weight.shape[1]) <= SLICE_ELEMENTS
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_warps: int = 4,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, K] (rows may be strided, the last dim contiguous), weight [N, K] that `fits` -> x weight^T
    (+ bias) [T, N]. T is compiled in: one program per row count."""
    n, k = weight.shape
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k or not fits(weight):
        raise ValueError(f"needs [T, {k}] rows with a contiguous last dim and a weight that fits")
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = block_n(k)
    launch: Any = gemv_kernel[(triton.cdiv(n, block),)]
    launch(
        x,
        weight,
        weight if bias is None else bias,  # a placeholder without a bias: never read
        out,
        x.stride(0),
        out.stride(0),
        ROWS=rows,
        N=n,
        K=k,
        K_PAD=triton.next_power_of_2(k),
        BLOCK_N=block,
        BIAS=bias is not None,
        num_warps=num_warps,
        **pdl_launch(pdl),
    )
    return out
