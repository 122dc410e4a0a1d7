"""FP8 linear kernels in Triton for the two regimes of a decode-serving engine.

- `fp8_weight_gemm`: a few rows (decode graphs) times FP8 weights, weight-only. A small-batch GEMM is
  bound by reading the weights, so it gains FP8's halved bytes without quantizing the activations: each
  weight tile is widened to bf16 in registers and multiplied on the tensor cores in float32, then scaled
  per output channel, or per 128 x 128 block for block-scaled checkpoints (their own numerics, not a
  per-channel re-quantization).
- `quantize_per_token`: one launch that turns bf16 rows into FP8 with a float32 scale per row, the input
  `torch._scaled_mm` takes for many rows, where the GEMM is bound by compute.

Triton ships with CUDA builds of torch; this module is imported only on CUDA (and by the kernel tests,
in Triton's CPU interpreter).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.layers.pdl import pdl_launch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_BLOCK = 128  # the block-scaled checkpoints' 128 x 128 weight blocks


@triton.jit
def fp8_weight_gemm_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rm[:, None] * stride_x
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w = tl.load(w_rows + k0 + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k0 + rk[None, :], mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # Triton's CPU interpreter multiplies bf16 as raw bits: widen to float32 there
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        if BLOCKWISE:
            # BLOCK_K divides SCALE_BLOCK: the tile lies in one K block; its rows may span N blocks.
            s = tl.load(s_ptr + (rn // SCALE_BLOCK) * stride_s + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if not BLOCKWISE:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + rm[:, None] * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & n_ok[None, :])


def fp8_weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_n: int = 16,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 4,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] (bf16, M <= 16) times the FP8 weight [N, K]^T -> [M, N] in x's dtype.

    `scale` is float32, [N] (per output channel) or [ceil(N / 128), K / 128] (per 128 x 128 block; then
    `block_k` must divide 128)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > 16 or x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError("needs at most 16 rows with a contiguous last dim and a contiguous [N, K] weight")
    blockwise = scale.dim() == 2
    if blockwise and SCALE_BLOCK % block_k:
        raise ValueError(f"block-scaled weights need block_k dividing {SCALE_BLOCK}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch: Any = fp8_weight_gemm_kernel[(triton.cdiv(n, block_n),)]
    launch(
        x, weight, scale, out, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, BLOCKWISE=blockwise, SCALE_BLOCK=SCALE_BLOCK,
        DOT_F32=x.device.type == "cpu", num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    return out


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
    as `Fp8MatMul`'s torch ops compute it, in one launch."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("needs rows with a contiguous last dim")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    launch: Any = quantize_per_token_kernel[(m,)]
    block = min(block, triton.next_power_of_2(k))
    launch(x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block)
    return q, scale
