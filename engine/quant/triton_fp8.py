"""Per-token FP8 quantization in one launch: bf16 rows -> FP8 with one float32 scale per row, the input
`torch._scaled_mm` takes (quant/fp8_linear.py's `ScaledMatMul`), in place of five torch ops.

Triton ships with CUDA builds of torch; this module is imported only on CUDA (and by the kernel test,
in Triton's CPU interpreter).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.quant.fp8_format import FP8, FP8_MAX


@triton.jit
def quantize_per_token_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token(x: torch.Tensor, *, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales [M, 1]) with scale = the row's largest magnitude / 448,
    as torch ops would compute it, in one launch."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("needs rows with a contiguous last dim")
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    launch: Any = quantize_per_token_kernel[(m,)]
    block = min(block, triton.next_power_of_2(k))
    launch(x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block)
    return q, scale
