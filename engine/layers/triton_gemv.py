"""x W^T for a few rows in Triton, each program holding its whole slice of the weight, for one-row decode
graphs, where a GEMM's time is mostly ramp and wait rather than bytes.

Each program owns `BLOCK_N` output features and loads their whole [BLOCK_N, K] slice of the weight into
registers before anything else. The weight is a constant, so under programmatic dependent launch (pdl.py)
that load runs while the kernel before it still computes the input; after the wait only the input row (a
few KB from L2) and the dot products are left. cuBLAS and tinygemm stream the weight after the input is
ready, or only a few stages of it before.

The rows run one after another over the same registers, so the kernel pays off for one row and loses to
cuBLAS and tinygemm by 4 rows (kernel-choices-chain.json); `gemv_max_bs` sets where the engine uses it.

FP8 weights (float8_e4m3fn, `WeightScales` per output channel or per block) take the same path as
weight-only decode: the program streams half the bytes and scales in registers, the activations stay
16-bit. Block scales multiply each block's partial sum; channel scales the finished sum.

Float32 products and sums, one rounding per output (the bias added first): the same contract as the
library GEMMs, which it matches up to summation order. Triton ships with CUDA builds of torch; imported
only on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.layers.low_rank import GemvDelta
from tandem.engine.layers.pdl import pdl_launch
from tandem.engine.layers.weight_scales import WeightScales

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
    # The low-rank delta (low_rank.py), all None / 0 without one (DELTA False).
    partial_ptr=None,
    b_ptr=None,
    slots_ptr=None,
    slices_ptr=None,
    stride_p_split=0,
    stride_p_row=0,
    stride_b_slot=0,
    DELTA: tl.constexpr = False,
    PIECES: tl.constexpr = 1,
    R: tl.constexpr = 16,
    R_PAD: tl.constexpr = 16,
    SPLITS: tl.constexpr = 1,
    SPLITS_PAD: tl.constexpr = 1,
    ROWS_PAD: tl.constexpr = 1,
    # An FP8 weight's scales: SCALE 0 none (16-bit weight), 1 per output channel, 2 per SB_N x SB_K block
    # (SCALE_COLS blocks a row; K_PAD a multiple of SB_K, a power of two).
    scale_ptr=None,
    SCALE: tl.constexpr = 0,
    SB_N: tl.constexpr = 1,
    SB_K: tl.constexpr = 1,
    SCALE_COLS: tl.constexpr = 1,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_PAD)
    col_mask = cols < N
    k_mask = ks < K
    w_mask = col_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_mask, other=0.0)
    if BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SCALE == 1:
        channel = tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SCALE == 2:
        kb = tl.arange(0, K_PAD // SB_K)
        s_at = scale_ptr + (cols // SB_N)[:, None] * SCALE_COLS + kb[None, :]
        blocks = tl.load(s_at, mask=col_mask[:, None] & (kb < SCALE_COLS)[None, :], other=0.0)
    if DELTA:
        # The slice of the program's columns (the host checked that no program's columns straddle two)
        # and every row's slot and B block: constants of the replay, so read before the wait too.
        piece = 0
        for j in tl.static_range(1, PIECES):
            piece += (tl.program_id(0) * BLOCK_N >= tl.load(slices_ptr + 2 * j)).to(tl.int32)
        rows = tl.arange(0, ROWS_PAD)
        slots = tl.load(slots_ptr + rows, mask=rows < ROWS, other=-1)
        rr = tl.arange(0, R_PAD)
        b_at = (b_ptr + tl.maximum(slots, 0)[:, None, None].to(tl.int64) * stride_b_slot
                + cols[None, :, None].to(tl.int64) * R + rr[None, None, :])  # fmt: skip
        b_mask = (slots >= 0)[:, None, None] & col_mask[None, :, None] & (rr < R)[None, None, :]
        b = tl.load(b_at, mask=b_mask, other=0.0).to(tl.float32)  # [ROWS_PAD, BLOCK_N, R_PAD]
    if PDL:
        # Only constants are read before the wait (the weight and its scales, and the delta's B and
        # slots), and nothing is written before it.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    w = w.to(tl.float32)
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        if SCALE == 2:
            parts = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, K_PAD // SB_K, SB_K)), axis=2)
            acc = tl.sum(parts * blocks, axis=1)
        else:
            acc = tl.sum(w * x[None, :], axis=1)
        if SCALE == 1:
            acc *= channel
        if BIAS:
            acc += bias
        if DELTA:
            # The shrink's partial sums of this row's slice, all at once, then B times their sum.
            splits = tl.arange(0, SPLITS_PAD)
            p_at = partial_ptr + splits[:, None] * stride_p_split + r * stride_p_row + piece * R + rr[None, :]
            p_mask = (splits < SPLITS)[:, None] & (rr < R)[None, :]
            s = tl.sum(tl.load(p_at, mask=p_mask, other=0.0), axis=0)  # [R_PAD]
            b_row = tl.sum(tl.where((rows == r)[:, None, None], b, 0.0), axis=0)  # [BLOCK_N, R_PAD]
            # A row without a slot adds nothing: its partials were never written, so maybe not finite.
            mine = tl.max(tl.where(rows == r, slots, -1)) >= 0
            acc += tl.where(mine, tl.sum(b_row * s[None, :], axis=1), 0.0)
        tl.store(out_ptr + r * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def block_n(k: int) -> int:
    """Output features per program: as many as keep its weight slice within `SLICE_ELEMENTS`, at most 16."""
    return max(1, min(16, SLICE_ELEMENTS // int(triton.next_power_of_2(k))))


def fits(weight: torch.Tensor, scales: WeightScales | None = None) -> bool:
    """Whether a [N, K] weight is one `gemv` takes: contiguous, a whole padded row within one program's
    slice (K up to 16,384), and 16-bit, or FP8 with `scales` whose blocks are at most a padded row wide
    and a power of two across."""
    if weight.dim() != 2 or not weight.is_contiguous():
        return False
    k_pad = triton.next_power_of_2(weight.shape[1])
    if scales is None:
        return weight.dtype in (torch.bfloat16, torch.float16) and k_pad <= SLICE_ELEMENTS
    block_k = 1 if scales.block is None else scales.block[1]
    return (
        weight.dtype == torch.float8_e4m3fn
        and scales.values.dtype == torch.float32
        and scales.values.is_contiguous()
        and max(k_pad, block_k) <= SLICE_ELEMENTS
        and block_k & (block_k - 1) == 0
    )


def takes_delta(weight: torch.Tensor, slice_offsets: Sequence[int]) -> bool:
    """Whether `gemv` can add a low-rank delta with these slices to this weight's outputs: no program's
    columns may straddle two slices."""
    block = block_n(weight.shape[1])
    return all(offset % block == 0 for offset in slice_offsets)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_warps: int = 4,
    pdl: bool = False,
    delta: GemvDelta | None = None,
    scales: WeightScales | None = None,
) -> torch.Tensor:
    """x [T, K] (rows may be strided, the last dim contiguous), weight [N, K] that `fits` (with `scales`
    for an FP8 one) -> x weight^T (+ bias) (+ `delta`, for a weight that `takes_delta` of its slices)
    [T, N] in x's dtype. T is compiled in: one program per row count."""
    n, k = weight.shape
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k or not fits(weight, scales):
        raise ValueError(f"needs [T, {k}] rows with a contiguous last dim and a weight that fits")
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = block_n(k)
    extra: dict[str, Any] = {}
    if delta is not None:
        p = delta.partial
        splits = p.shape[0]
        extra = {
            "partial_ptr": p,
            "b_ptr": delta.b,
            "slots_ptr": delta.token_slots,
            "slices_ptr": delta.slices,
            "stride_p_split": p.stride(0),
            "stride_p_row": p.stride(1),
            "stride_b_slot": delta.b.stride(0),
            "DELTA": True,
            "PIECES": delta.pieces,
            "R": delta.rank,
            "R_PAD": max(16, triton.next_power_of_2(delta.rank)),
            "SPLITS": splits,
            "SPLITS_PAD": triton.next_power_of_2(splits),
            "ROWS_PAD": triton.next_power_of_2(rows),
        }
    k_pad = triton.next_power_of_2(k)
    if scales is not None:
        values = scales.values
        extra["scale_ptr"] = values
        if scales.block is None:
            extra["SCALE"] = 1
        else:
            k_pad = max(k_pad, scales.block[1])
            extra.update(SCALE=2, SB_N=scales.block[0], SB_K=scales.block[1], SCALE_COLS=values.shape[1])
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
        K_PAD=k_pad,
        BLOCK_N=block,
        BIAS=bias is not None,
        num_warps=num_warps,
        **pdl_launch(pdl),
        **extra,
    )
    return out
