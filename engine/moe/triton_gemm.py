"""The experts' grouped GEMMs in Triton, over the (token, expert) pairs that triton_route.py grouped by
expert, and the per-token sum of the top k.

One kernel serves both GEMMs. Each program takes one block of BM rows, all of one local expert, and BN
output features: the expert's weight tile is read once for all its rows, so a decode batch reads every
chosen expert's weights once. The up GEMM (`GATED`) runs the gate and up rows of [x W13^T] as two
accumulators and stores silu(gate) * up, the activation, per pair; the down GEMM multiplies its result
by the pair's routing weight and stores one row per pair. `sum_kernel` then adds each token's k rows in
a fixed order (no atomics: the same inputs give the same bits), plus sigmoid(gate) * a shared expert's
output where the model has one. Blocks past the padded total (a device value) return at once.

Products and sums in float32 (tl.dot); the activation and the per-pair rows are rounded to the model's
dtype once, as the library GEMMs round their outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.engine.moe.triton_mxfp4 import mxfp4_tile


@triton.jit(do_not_specialize=["num_pairs", "max_row_blocks"])
def grouped_gemm_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_experts_ptr,
    total_ptr,
    weights_ptr,
    num_pairs,
    max_row_blocks,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    bias_ptr=None,
    stride_bias=0,
    alpha=1.0,
    limit=0.0,
    HAS_BIAS: tl.constexpr = False,
    CLAMPED: tl.constexpr = False,
    scales_ptr=None,
    stride_se=0,
    stride_sn=0,
    MXFP4: tl.constexpr = False,
    FP8: tl.constexpr = False,
    SB_N: tl.constexpr = 128,
    SB_K: tl.constexpr = 128,
):
    """out[pair, n] for n < N: GATED, silu(a W[:N]^T) * (a W[N:2N]^T) (W [2N, K], the gate rows first);
    else (a W^T) * weights[pair] (W [N, K]). a's row is pair // A_ROW_DIV (the token for the up GEMM,
    the pair itself for the down GEMM). HAS_BIAS: the expert's bias row (bias [E_local, 2N] gated, else
    [E_local, N]) added to the products first; CLAMPED: gpt-oss's clamped SwiGLU for the gated one.
    MXFP4: W is packed (uint8 [E, rows, K / 2], its byte strides stride_we, stride_wn) with e8m0 scales
    (uint8 [E, rows, K / 32], strides stride_se, stride_sn), unpacked into the activation's dtype per
    tile as its even-k and odd-k halves, one tl.dot each (triton_mxfp4.py); BK a multiple of 32. FP8:
    W is float8_e4m3fn with float32 scales per SB_N x SB_K block ([E, block rows, block columns], the
    gated weight's gate blocks then its up blocks, strides stride_se, stride_sn): each K step's product
    times its columns' scales (triton_fp8.py); BK divides SB_K."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BN)
    # Grouped order: GROUP_M blocks of rows share each weight tile while it is in L2.
    in_group = GROUP_M * blocks_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(max_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if pid_m * BM >= tl.load(total_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    live = rows < num_pairs
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_mask = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    # MXFP4: each weight row's first byte and first scale.
    w_rows = expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    s_rows = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    # FP8: each column's first block scale; the up rows' blocks follow the gate's ceil(N / SB_N).
    s_blocks = expert * stride_se + (cols[None, :] // SB_N).to(tl.int64) * stride_sn
    up_blocks = s_blocks + ((N + SB_N - 1) // SB_N) * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = ks < K - k0
        w_mask = k_mask[:, None] & col_mask[None, :]
        a = tl.load(a_ptrs, mask=live[:, None] & k_mask[None, :], other=0.0)
        if MXFP4:
            # The weights as byte tiles [BK / 2, BN], in two halves of k (even, odd): one tl.dot for each
            # half, with the matching half of a's columns, so the tile is never interleaved.
            a_even, a_odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            left = tl.multiple_of(K - k0, 32)
            w_even, w_odd = mxfp4_tile(w_ptr, scales_ptr, w_rows, s_rows, col_mask[None, :], k0, left, BK, 0)
            acc = tl.dot(a_even, w_even.to(a.dtype), acc)
            acc = tl.dot(a_odd, w_odd.to(a.dtype), acc)
            if GATED:
                up_rows, up_scales = w_rows + N * stride_wn, s_rows + N * stride_sn
                up_even, up_odd = mxfp4_tile(w_ptr, scales_ptr, up_rows, up_scales, col_mask[None, :], k0,
                                             left, BK, 0)  # fmt: skip
                acc_up = tl.dot(a_even, up_even.to(a.dtype), acc_up)
                acc_up = tl.dot(a_odd, up_odd.to(a.dtype), acc_up)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if FP8:
                scale = tl.load(scales_ptr + s_blocks + k0 // SB_K, mask=col_mask[None, :], other=0.0)
                acc += tl.dot(a, w.to(a.dtype)) * scale
            else:
                acc = tl.dot(a, w, acc)
            if GATED:
                up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
                if FP8:
                    scale = tl.load(scales_ptr + up_blocks + k0 // SB_K, mask=col_mask[None, :], other=0.0)
                    acc_up += tl.dot(a, up.to(a.dtype)) * scale
                else:
                    acc_up = tl.dot(a, up, acc_up)
        a_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_bias + cols
        acc += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias + N, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if CLAMPED:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + rows, mask=live, other=0.0)[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_mask[None, :])


@triton.jit
def sum_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    pairs_ptr,
    ids_ptr,
    out_ptr,
    shared_ptr,
    shared_gate_ptr,
    hidden,
    stride_pairs,
    stride_out,
    stride_shared,
    stride_gate,
    expert_start,
    num_local,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    BH: tl.constexpr,
    SHARED: tl.constexpr,
):
    """out[t] = sum over this rank's experts j of pairs[t * TOPK + j] (+ sigmoid(gate[t]) * shared[t])."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_mask = cols < hidden
    slots = tl.arange(0, K_PAD)
    expert = tl.load(ids_ptr + token * TOPK + slots, mask=slots < TOPK, other=-1) - expert_start
    mine = (slots < TOPK) & (expert >= 0) & (expert < num_local)
    rows = token * TOPK + slots
    parts = tl.load(
        pairs_ptr + rows[:, None] * stride_pairs + cols[None, :],
        mask=mine[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(parts, axis=0)
    if SHARED:
        gate = tl.load(shared_gate_ptr + token * stride_gate).to(tl.float32)
        shared = tl.load(shared_ptr + token * stride_shared + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc += shared / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
