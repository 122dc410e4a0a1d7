"""SiLU-and-multiply of a few rows in Triton: silu(gate) * up over the MLP's merged gate/up output, for
small decode graphs, where flashinfer's kernel is mostly launch and ramp for about 100 KB of data, and a
Llama-3.1-8B step runs 32 of them (timed in benchmarks/results/kernel-choices-act-store.json).

Same numerics as flashinfer's `silu_and_mul`: float32 math, one rounding. One program per block of a row;
with PDL (pdl.py) the block waits for the gate/up projection before its first read.

Triton ships with CUDA builds of torch; this module is imported only on CUDA, never on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.layers.pdl import pdl_launch


@triton.jit
def silu_and_mul_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr, out_ptr, stride_x, stride_out, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor, *, block: int = 1024, num_warps: int = 4, pdl: bool = False
) -> torch.Tensor:
    """x [T, 2N] (gate then up; rows may be strided, the last dim contiguous) -> silu(gate) * up [T, N]."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2:
        raise ValueError("needs [T, 2N] rows with a contiguous last dim")
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    launch: Any = silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))]
    launch(x, out, x.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=num_warps, **pdl_launch(pdl))
    return out
