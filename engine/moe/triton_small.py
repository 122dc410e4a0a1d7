"""The experts for one or two tokens (decode at batch 1 and 2), in three Triton launches and no grouping.

At that size a token's k experts are all different and no two tokens share many, so there is nothing to
group. `choose_kernel` routes each token once (the router's softmax and top k, from the logits, as
triton_route.py does: a few hundred floats) into ids and weights; `up_kernel` runs one program per (pair,
BN features) that computes silu(gate) * up for its pair's expert as a GEMV; `down_kernel` runs one
program per (token, BN features) that adds its k experts' down projections, weighted, in routing order,
plus a shared expert's gated output where there is one. Launched with PDL, each kernel is launched while
the one before drains and waits for it before reading anything. The routed experts so cost three
launches in a decode graph, against five for the grouped path (route, align, two GEMMs, sum).

Without `ROUTED`, up and down programs route their token for themselves and choose_kernel is not
launched: two launches, but the routing is repeated by every program, which costs more than the launch
it saves (benchmarks/kernels/moe_small_variants.py measures both).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.engine.moe.triton_fp8 import fp8_block_dot
from tandem.engine.moe.triton_mxfp4 import mxfp4_tile
from tandem.engine.moe.triton_route import topk_rows


@triton.jit
def choose_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    logits_ptr,
    ids_ptr,
    weights_ptr,
    stride_logits,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    PDL: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr = False,
):
    """ids[token, j], weights[token, j]: the token's top k experts (global ids) and their weights. One
    program a token, launched with one warp, whose reductions are shuffles with no shared memory."""
    token = tl.program_id(0)
    if PDL:  # reads only the router's logits, after the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = token + tl.arange(0, 1)
    ids, weights = topk_rows(
        logits_ptr, rows, rows >= 0, stride_logits, E, E_PAD, TOPK, K_PAD, RENORM, 1, TOPK_SOFTMAX
    )
    slots = tl.arange(0, K_PAD)
    at = rows[:, None].to(tl.int64) * TOPK + slots[None, :]
    mask = slots[None, :] < TOPK
    tl.store(ids_ptr + at, ids, mask=mask)
    tl.store(weights_ptr + at, weights, mask=mask)


@triton.jit
def up_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    logits_ptr,
    ids_ptr,
    w13_ptr,
    act_ptr,
    stride_x,
    stride_logits,
    stride_we,
    expert_start,
    num_local,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROUTED: tl.constexpr,
    PDL: tl.constexpr,
    b13_ptr=None,
    stride_b13=0,
    alpha=1.0,
    limit=0.0,
    HAS_BIAS: tl.constexpr = False,
    CLAMPED: tl.constexpr = False,
    TOPK_SOFTMAX: tl.constexpr = False,
    s13_ptr=None,
    stride_se=0,
    MXFP4: tl.constexpr = False,
    FP8: tl.constexpr = False,
    SB_N: tl.constexpr = 128,
    SB_K: tl.constexpr = 128,
):
    """act[pair, n] = silu(x W_gate[n]) * (x W_up[n]) for the pair's expert; nothing for another rank's.
    The expert is ids[pair] where choose_kernel ran (ROUTED), else this program's own top k. HAS_BIAS:
    the expert's gate and up biases (b13 [E_local, 2 INTER]) added first; CLAMPED: gpt-oss's clamped
    SwiGLU instead of silu(gate) * up. MXFP4: w13 is packed, uint8 [E_local, 2 INTER, HIDDEN / 2] (byte
    stride stride_we), with its scales s13 [E_local, 2 INTER, HIDDEN / 32] (stride stride_se)."""
    pair = tl.program_id(0)
    token = pair // TOPK
    if PDL:  # the expert, and so every weight address, comes from an earlier kernel: nothing before
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if ROUTED:
        expert = tl.load(ids_ptr + pair) - expert_start
    else:
        rows = token + tl.arange(0, 1)
        ids, _ = topk_rows(
            logits_ptr, rows, rows >= 0, stride_logits, E, E_PAD, TOPK, K_PAD, RENORM, 1, TOPK_SOFTMAX
        )
        slots = tl.arange(0, K_PAD)
        expert = tl.sum(tl.where(slots[None, :] == pair % TOPK, ids, 0)) - expert_start
    if (expert < 0) | (expert >= num_local):
        return
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_mask = cols < INTER
    gate_rows = w13_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * HIDDEN
    # MXFP4: the gate rows' first bytes and scales; the up rows follow INTER rows on.
    gate_bytes = expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * (HIDDEN // 2)
    gate_scales = expert.to(tl.int64) * stride_se + cols[:, None].to(tl.int64) * (HIDDEN // 32)
    # FP8: the rows' first block scales; the up rows' follow the gate's ceil(INTER / SB_N) block rows.
    s_cols = (HIDDEN + SB_K - 1) // SB_K
    gate_blocks = expert.to(tl.int64) * stride_se + (cols[:, None] // SB_N).to(tl.int64) * s_cols
    up_blocks = gate_blocks + ((INTER + SB_N - 1) // SB_N) * s_cols
    elements = expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * HIDDEN
    acc_gate = tl.zeros([BN], dtype=tl.float32)
    acc_up = tl.zeros([BN], dtype=tl.float32)
    # Unrolled (one step where the hidden size fits a block), so the weight loads are not held back by
    # a loop: the program streams its whole slice at once.
    for k0 in tl.static_range(0, HIDDEN, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < HIDDEN
        x = tl.load(x_ptr + token.to(tl.int64) * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        m = col_mask[:, None] & k_mask[None, :]
        if FP8:
            up_elements = elements + INTER * HIDDEN
            acc_gate += fp8_block_dot(w13_ptr, s13_ptr, elements, gate_blocks, k0, x, m, col_mask[:, None],
                                      s_cols, BN, BK, SB_K)  # fmt: skip
            acc_up += fp8_block_dot(w13_ptr, s13_ptr, up_elements, up_blocks, k0, x, m, col_mask[:, None],
                                    s_cols, BN, BK, SB_K)  # fmt: skip
        elif MXFP4:
            # The weights as byte tiles, in two halves of k (even, odd), which meet x's two halves.
            x_even, x_odd = tl.split(tl.reshape(x, (BK // 2, 2)))
            up_bytes = gate_bytes + INTER * (HIDDEN // 2)
            up_scales = gate_scales + INTER * (HIDDEN // 32)
            gate_even, gate_odd = mxfp4_tile(w13_ptr, s13_ptr, gate_bytes, gate_scales, col_mask[:, None], k0,
                                             HIDDEN - k0, BK, 1)  # fmt: skip
            up_even, up_odd = mxfp4_tile(w13_ptr, s13_ptr, up_bytes, up_scales, col_mask[:, None], k0,
                                         HIDDEN - k0, BK, 1)  # fmt: skip
            acc_gate += tl.sum(gate_even * x_even[None, :] + gate_odd * x_odd[None, :], axis=1)
            acc_up += tl.sum(up_even * x_even[None, :] + up_odd * x_odd[None, :], axis=1)
        else:
            gate = tl.load(gate_rows + ks[None, :], mask=m, other=0.0).to(tl.float32)
            up = tl.load(gate_rows + INTER * HIDDEN + ks[None, :], mask=m, other=0.0).to(tl.float32)
            acc_gate += tl.sum(gate * x[None, :], axis=1)
            acc_up += tl.sum(up * x[None, :], axis=1)
    if HAS_BIAS:
        bias = b13_ptr + expert.to(tl.int64) * stride_b13 + cols
        acc_gate += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)
        acc_up += tl.load(bias + INTER, mask=col_mask, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(act_ptr + pair.to(tl.int64) * INTER + cols, act.to(act_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def down_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    act_ptr,
    logits_ptr,
    ids_ptr,
    weights_ptr,
    w2_ptr,
    out_ptr,
    shared_ptr,
    shared_gate_ptr,
    stride_logits,
    stride_we,
    stride_out,
    stride_shared,
    stride_gate,
    expert_start,
    num_local,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SHARED: tl.constexpr,
    ROUTED: tl.constexpr,
    PDL: tl.constexpr,
    b2_ptr=None,
    stride_b2=0,
    HAS_BIAS: tl.constexpr = False,
    TOPK_SOFTMAX: tl.constexpr = False,
    s2_ptr=None,
    stride_se=0,
    MXFP4: tl.constexpr = False,
    FP8: tl.constexpr = False,
    SB_N: tl.constexpr = 128,
    SB_K: tl.constexpr = 128,
):
    """out[token, n] = sum_j w_j (act[token * TOPK + j] W_down[e_j][n] (+ b2[e_j][n] with HAS_BIAS)) over
    this rank's experts (+ sigmoid(gate) * shared[token, n]). MXFP4: w2 is packed, uint8 [E_local, HIDDEN,
    INTER / 2] (byte stride stride_we), with its scales s2 [E_local, HIDDEN, INTER / 32] (stride_se).
    FP8: w2 is float8_e4m3fn with float32 scales s2 [E_local, ceil(HIDDEN / SB_N), ceil(INTER / SB_K)]
    (stride_se) applied per block (triton_fp8.py); BK a multiple of SB_K."""
    token = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if not ROUTED:
        rows = token + tl.arange(0, 1)
        ids, weights = topk_rows(
            logits_ptr, rows, rows >= 0, stride_logits, E, E_PAD, TOPK, K_PAD, RENORM, 1, TOPK_SOFTMAX
        )
        slots = tl.arange(0, K_PAD)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_mask = cols < HIDDEN
    acc = tl.zeros([BN], dtype=tl.float32)
    # All unrolled: the k experts' weight loads are independent and may all be in flight at once.
    for j in tl.static_range(TOPK):
        if ROUTED:
            expert = tl.load(ids_ptr + token * TOPK + j) - expert_start
            weight = tl.load(weights_ptr + token * TOPK + j)
        else:
            expert = tl.sum(tl.where(slots[None, :] == j, ids, 0)) - expert_start
            weight = tl.sum(tl.where(slots[None, :] == j, weights, 0.0))
        mine = (expert >= 0) & (expert < num_local)
        # Another rank's expert reads nothing: its reduction length is 0.
        length = tl.where(mine, INTER, 0)
        rows_of = cols[:, None].to(tl.int64) * INTER
        base = w2_ptr + tl.where(mine, expert, 0).to(tl.int64) * stride_we + rows_of
        local = tl.where(mine, expert, 0).to(tl.int64)
        row_bytes = local * stride_we + cols[:, None].to(tl.int64) * (INTER // 2)
        row_scales = local * stride_se + cols[:, None].to(tl.int64) * (INTER // 32)
        s_cols = (INTER + SB_K - 1) // SB_K
        blocks = local * stride_se + (cols[:, None] // SB_N).to(tl.int64) * s_cols
        elements = local * stride_we + rows_of
        act_row = act_ptr + (token * TOPK + j).to(tl.int64) * INTER
        part = tl.zeros([BN], dtype=tl.float32)
        for k0 in tl.static_range(0, INTER, BK):
            ks = k0 + tl.arange(0, BK)
            k_mask = ks < length
            a = tl.load(act_row + ks, mask=k_mask, other=0.0).to(tl.float32)
            m = col_mask[:, None] & k_mask[None, :]
            if FP8:
                part += fp8_block_dot(w2_ptr, s2_ptr, elements, blocks, k0, a, m, col_mask[:, None], s_cols,
                                      BN, BK, SB_K)  # fmt: skip
            elif MXFP4:
                a_even, a_odd = tl.split(tl.reshape(a, (BK // 2, 2)))
                w_even, w_odd = mxfp4_tile(w2_ptr, s2_ptr, row_bytes, row_scales, col_mask[:, None], k0,
                                           length - k0, BK, 1)  # fmt: skip
                part += tl.sum(w_even * a_even[None, :] + w_odd * a_odd[None, :], axis=1)
            else:
                w = tl.load(base + ks[None, :], mask=m, other=0.0).to(tl.float32)
                part += tl.sum(w * a[None, :], axis=1)
        if HAS_BIAS:
            # Another rank's expert reads local expert 0's row (a valid address) and adds none of it.
            bias = b2_ptr + tl.where(mine, expert, 0).to(tl.int64) * stride_b2 + cols
            part += tl.where(mine, tl.load(bias, mask=col_mask, other=0.0).to(tl.float32), 0.0)
        acc += weight * part
    if SHARED:
        gate = tl.load(shared_gate_ptr + token.to(tl.int64) * stride_gate).to(tl.float32)
        row = shared_ptr + token.to(tl.int64) * stride_shared + cols
        acc += tl.load(row, mask=col_mask, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
    out = out_ptr + token.to(tl.int64) * stride_out + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
