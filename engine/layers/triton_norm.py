"""The residual add and RMS norm of a few rows in one Triton program per row: a candidate for small decode
batches, where flashinfer's fused add + norm is mostly launch and ramp for a few KB of data, and a
Llama-3.1-8B step runs 64 of them (timed in benchmarks/results/kernel-choices-act-store.json).

Same contract as flashinfer's `fused_add_rmsnorm`, in place: residual += x, then x = norm(residual).
Numerics follow the torch reference: the sum is rounded to the residual's dtype, then normalised in
float32 and rounded once. Without a residual it is the plain norm, written to `out`.

Triton ships with CUDA builds of torch; this module is imported only on CUDA, never on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.layers.pdl import pdl_launch


@triton.jit
def add_rmsnorm_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    GEMMA: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        # Launched before the previous kernel ends: only the weight (a constant) is read before the wait.
        # The next kernel may start now (a GEMM then streams its weights in while this runs).
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, total, mask=mask)
        x = total.to(tl.float32)
    if GEMMA:
        w = w + 1.0
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(out_ptr + row * stride_out + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool,
    num_warps: int = 8,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, N] (rows may be strided, the last dim contiguous). With `residual` [T, N]: residual += x and
    x = norm(residual), in place, returning x. Without: a new tensor norm(x).

    `pdl`: a programmatic dependent launch (Hopper and later, see pdl.py)."""
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("needs [T, N] rows with a contiguous last dim")
    n = x.shape[1]
    out = x if residual is not None else torch.empty_like(x)
    launch: Any = add_rmsnorm_kernel[(x.shape[0],)]
    launch(
        x,
        x if residual is None else residual,  # a placeholder without a residual: never read
        weight,
        out,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        eps,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        ADD=residual is not None,
        GEMMA=gemma,
        num_warps=num_warps,
        **pdl_launch(pdl),
    )
    return out
