"""The one-launch decode's building blocks (triton_decode.py): the q/k norm and rope of the new token, a
block of paged K/V, a step of the online softmax, a program's walk over its share of a row, and the two ways
a program ends (a (row, head, split) program's, and a planned work item's)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _norm_rope(  # type: ignore[no-untyped-def]  # tensors and constexprs
    x1, x2, w_ptr, cos, sin, eps, DT: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr
):
    """Heads' two halves (float32, [heads, D / 2]) -> rotated halves, rounded to DT (the cache's dtype)."""
    half = tl.arange(0, D // 2)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=-1) + tl.sum(x2 * x2, axis=-1)) / D + eps)
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
        if GEMMA:
            w1 = w1 + 1.0
            w2 = w2 + 1.0
        x1 = (x1 * tl.expand_dims(rstd, -1) * w1).to(DT).to(tl.float32)  # the norm's rounding
        x2 = (x2 * tl.expand_dims(rstd, -1) * w2).to(DT).to(tl.float32)
    return (x1 * cos - x2 * sin).to(DT), (x2 * cos + x1 * sin).to(DT)


@triton.jit
def _kv_block(  # type: ignore[no-untyped-def]  # tensors and constexprs
    k_cache_ptr,
    v_cache_ptr,
    indices_ptr,
    start_page,
    begin,
    hi,
    h,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The K (two halves) and V of a row's tokens [begin, begin + BLOCK_N), zero from `hi` on."""
    t = begin + tl.arange(0, BLOCK_N)
    half = tl.arange(0, D // 2)
    valid = t < hi
    page = tl.load(indices_ptr + start_page + t // PAGE, mask=valid, other=0).to(tl.int64)
    rows = ((page * PAGE + t % PAGE) * HKV + h)[:, None] * D
    kb1 = tl.load(k_cache_ptr + rows + half[None, :], mask=valid[:, None], other=0.0)
    kb2 = tl.load(k_cache_ptr + rows + D // 2 + half[None, :], mask=valid[:, None], other=0.0)
    vb = tl.load(v_cache_ptr + rows + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    return kb1, kb2, vb, valid


@triton.jit
def _attend(q1, q2, kb1, kb2, vb, valid, m, acc, total, qk_scale):  # type: ignore[no-untyped-def]
    """One block of the online softmax: (m, acc, total) after the block's scores and values."""
    scores = (tl.dot(q1, tl.trans(kb1)) + tl.dot(q2, tl.trans(kb2))) * qk_scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
    return m_new, acc, total * alpha + tl.sum(p, 1)


@triton.jit
def attend_share(  # type: ignore[no-untyped-def]  # pointers, tensors and constexprs
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    indices_ptr,
    stride_qkv,
    eps,
    qk_scale,
    cos,
    sin,
    slot,
    start_page,
    lo,
    hi,
    b,
    h,
    first,  # this program owns the row's new token
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """One program's softmax state (m, acc, total) over the row's earlier tokens [lo, hi), plus the new
    token where `first` (which also stores the new K/V)."""
    g = tl.arange(0, GROUP_PAD)
    half = tl.arange(0, D // 2)
    d = tl.arange(0, D)
    in_group = g < GROUP
    row = qkv_ptr + b * stride_qkv
    heads = (h * GROUP + g)[:, None] * D
    qx1 = tl.load(row + heads + half[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
    qx2 = tl.load(row + heads + D // 2 + half[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(
        qx1, qx2, qw_ptr, cos[None, :], sin[None, :], eps, k_cache_ptr.dtype.element_ty, D, NORM, GEMMA
    )
    k_row = row + (HQ + h) * D
    kx1 = tl.load(k_row + half[None, :]).to(tl.float32)  # [1, D / 2]: one head, as the q block's rows
    kx2 = tl.load(k_row + D // 2 + half[None, :]).to(tl.float32)
    k1, k2 = _norm_rope(
        kx1, kx2, kw_ptr, cos[None, :], sin[None, :], eps, k_cache_ptr.dtype.element_ty, D, NORM, GEMMA
    )
    v_new = tl.load(row + (HQ + HKV + h) * D + d[None, :])  # [1, D]

    # The first program of a row owns the new token: it stores its K/V and starts its softmax from it.
    # Their masks are `first` over the whole tile, written as a select, not `first & tile`: Triton's CPU
    # interpreter (3.9) types a comparison's result as its operands' int32, so splatting the scalar `first`
    # gives int32, not booleans, and it rejects that as a mask. Compiled, the two are the same code.
    own_half = tl.where(first, (half < D // 2)[None, :], False)
    own_d = tl.where(first, (d < D)[None, :], False)
    tl.store(k_cache_ptr + slot * D + half[None, :], k1, mask=own_half)
    tl.store(k_cache_ptr + slot * D + D // 2 + half[None, :], k2, mask=own_half)
    tl.store(v_cache_ptr + slot * D + d[None, :], v_new, mask=own_d)
    new_score = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), 1) + tl.sum(
        q2.to(tl.float32) * k2.to(tl.float32), 1
    )
    m = tl.where(first, new_score * qk_scale, float("-inf"))
    total = tl.where(first, 1.0, 0.0) + tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32) + tl.where(first, v_new.to(tl.float32), 0.0)

    for begin in range(lo, hi, BLOCK_N):
        kb1, kb2, vb, valid = _kv_block(
            k_cache_ptr, v_cache_ptr, indices_ptr, start_page, begin, hi, h, HKV, D, PAGE, BLOCK_N
        )
        m, acc, total = _attend(q1, q2, kb1, kb2, vb, valid, m, acc, total, qk_scale)
    return m, acc, total


@triton.jit
def split_epilogue(  # type: ignore[no-untyped-def]  # pointers, tensors and constexprs
    m,
    acc,
    total,
    part_o_ptr,
    part_lse_ptr,
    tickets_ptr,
    out_ptr,
    b,
    h,
    s,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """A (row, KV head, split) program's end: the output itself with one split, else its partial and a
    ticket; the last ticket of the (row, KV head) merges the splits."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    in_group = g < GROUP
    gp = tl.arange(0, GROUP_P2)
    if SPLITS == 1:
        out = acc / total[:, None]
        dst = out_ptr + (b * HQ + h * GROUP + g)[:, None] * D + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
    else:
        # An empty split (a short row) weighs nothing in the merge.
        seen = total > 0
        lse = tl.where(seen, m + tl.log2(tl.where(seen, total, 1.0)), float("-inf"))
        o = acc / tl.where(seen, total, 1.0)[:, None]
        base = (b * HKV + h) * SPLITS
        keep = g < GROUP_P2
        tl.store(part_o_ptr + ((base + s) * GROUP_P2 + g)[:, None] * D + d[None, :], o, mask=keep[:, None])
        tl.store(part_lse_ptr + (base + s) * GROUP_P2 + g, lse, mask=keep)
        # Every thread's partial stores come before the ticket (the barrier), the ticket releases them.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + b * HKV + h, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            splits = tl.arange(0, SPLITS)
            lses = tl.load(
                part_lse_ptr + (base + splits)[:, None] * GROUP_P2 + gp[None, :], cache_modifier=".cg"
            )
            top = tl.max(lses, axis=0)  # split 0 always saw the new token
            weights = tl.exp2(lses - top[None, :])  # [SPLITS, GROUP_P2]
            parts = tl.load(
                part_o_ptr
                + ((base + splits)[:, None, None] * GROUP_P2 + gp[None, :, None]) * D
                + d[None, None, :],
                cache_modifier=".cg",
            )
            merged = tl.sum(weights[:, :, None] * parts, axis=0) / tl.sum(weights, axis=0)[:, None]
            dst = out_ptr + (b * HQ + h * GROUP + gp)[:, None] * D + d[None, :]
            tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=(gp < GROUP)[:, None])
            tl.atomic_xchg(tickets_ptr + b * HKV + h, 0)
