"""Block-scaled FP8 weights read inside the MoE kernels (W8A16): the weights stay float8_e4m3fn in GPU
memory, the activations 16-bit; each weight is upcast in registers and its block's scale applied to the
partial sum of that block, as the dense GEMV does it (layers/triton_gemv.py).

The layout the kernels read (MoEExperts' resident FP8 experts): the weight rows as the checkpoint has
them, [.., N, K] float8_e4m3fn, and float32 scales [.., ceil(N / SB_N), ceil(K / SB_K)], one per
SB_N x SB_K block (the hub's `weight_scale_inv`, which multiplies: w = w_fp8 * scale). The experts' gate
and up rows are stacked in one weight, so their scales are too: the gate's ceil(N / SB_N) block rows,
then the up's. SB_K is a power of two (the kernels reshape a K step into its blocks).

The grouped GEMM (triton_gemm.py) takes K steps no wider than a block, so each step has one scale per
output column: tl.dot of the 16-bit activations with the upcast FP8 tile (exact: e4m3 fits bf16 and
fp16), times the columns' scales. The GEMVs (triton_small.py) use `fp8_block_dot` below.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_block_dot(  # type: ignore[no-untyped-def]  # pointers and constexprs
    w_ptr,
    scales_ptr,
    w_rows,
    scale_rows,
    k0,
    x,
    mask,
    row_mask,
    scale_cols,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SB_K: tl.constexpr,
):
    """sum over k in [k0, k0 + BK) of w[n, k] x[k] for BN rows, in float32: `w_rows` [BN, 1] the rows'
    first elements in `w_ptr`, `scale_rows` [BN, 1] their scale rows' first elements in `scales_ptr`
    (`scale_cols` blocks a row), `x` [BK] float32, `mask` [BN, BK] the weights to read, `row_mask`
    [BN, 1] the rows that exist. Each SB_K-wide block's partial sum is multiplied by its scale; BK is a
    multiple of SB_K and k0 of BK."""
    ks = k0 + tl.arange(0, BK)
    w = tl.load(w_ptr + w_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    parts = tl.sum(tl.reshape(w * x[None, :], (BN, BK // SB_K, SB_K)), axis=2)  # [BN, BK / SB_K]
    kb = k0 // SB_K + tl.arange(0, BK // SB_K)
    s_mask = row_mask & (kb < scale_cols)[None, :]
    scales = tl.load(scales_ptr + scale_rows + kb[None, :], mask=s_mask, other=0.0)
    return tl.sum(parts * scales, axis=1)
