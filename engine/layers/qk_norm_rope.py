"""Per-head q and k RMS norms and the rotate-half rope in one Triton launch, and optionally the K/V
store into the paged cache as well.

Why: on Qwen3 and Gemma 3 each layer would otherwise run three small flashinfer kernels between the
q/k/v projection and attention (the q norm, the k norm, the rope), each taking far longer than reading
the data it touches. Here one program normalises and rotates a block of heads of one token, reading the
merged projection output once and writing contiguous q and k, as the rope kernel did; alone in CUDA
graphs it beats the three kernels at every batch size (benchmarks/results/kernel-choices-qk-norm-rope.json).
`FusedKernels.qk_norm_rope` runs it on CUDA.

Without q/k norm weights it is the rope alone (Llama, Mistral, Qwen2, Gemma 2), so every model whose
rope covers the whole head takes the same kernel.

With `kv_cache` it writes the rotated k and the untouched v straight into the paged cache at each
token's slot instead, taking the place of the append kernel too (faster than the three kernels and
flashinfer's append, in the same file). The model takes that form wherever the attention backend hands
it the new tokens' slots (`AttentionBackend.new_kv_slots`): flashinfer's decode graphs and eager batches.

Numerics follow the flashinfer chain: each norm is computed in float32 and rounded once to the output
dtype (the Gemma form scales by 1 + w), and the rope rotates those rounded values in float32 with the
shared cos/sin table (`FusedKernels.cos_sin_table`: cos in the first half, sin in the second). Checked
against the torch reference in Triton's CPU interpreter (tests/kernels/test_triton_qk_norm_rope.py) and
on the GPU (tests/gpu/test_fused_kernels.py).

Triton ships with CUDA builds of torch; this module is imported only on CUDA, never on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def qk_norm_rope_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    qkv_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    table_ptr,
    q_out_ptr,
    k_out_ptr,
    slot_ptr,
    v_cache_ptr,
    stride_qkv,
    stride_table,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GEMMA: tl.constexpr,
    APPEND: tl.constexpr,  # k_out_ptr is the K cache [slots, HKV, D]; v goes to v_cache_ptr
    NORM: tl.constexpr,  # per-head RMS norms before the rope; without, qw_ptr and kw_ptr are unused
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # q heads first, then k heads
    half = tl.arange(0, D // 2)
    valid = heads < HQ + HKV
    is_q = heads < HQ
    row = qkv_ptr + t * stride_qkv + heads[:, None] * D
    x1 = tl.load(row + half[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row + D // 2 + half[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(qw_ptr + half)[None, :], tl.load(kw_ptr + half)[None, :])
        w2 = tl.where(
            is_q[:, None], tl.load(qw_ptr + D // 2 + half)[None, :], tl.load(kw_ptr + D // 2 + half)[None, :]
        )
        w1 = w1.to(tl.float32)
        w2 = w2.to(tl.float32)
        if GEMMA:
            w1 = w1 + 1.0
            w2 = w2 + 1.0
        y1 = (x1 * rstd * w1).to(out_ty).to(tl.float32)  # the norm's one rounding
        y2 = (x2 * rstd * w2).to(out_ty).to(tl.float32)
    else:
        y1 = x1
        y2 = x2
    pos = tl.load(pos_ptr + t)
    cos = tl.load(table_ptr + pos * stride_table + half)[None, :]
    sin = tl.load(table_ptr + pos * stride_table + D // 2 + half)[None, :]
    o1 = (y1 * cos - y2 * sin).to(out_ty)
    o2 = (y2 * cos + y1 * sin).to(out_ty)
    kv_head = tl.where(is_q, 0, heads - HQ)
    q_row = q_out_ptr + t * HQ * D + tl.where(is_q, heads, 0)[:, None] * D
    q_mask = (valid & is_q)[:, None]
    k_mask = (valid & ~is_q)[:, None]
    tl.store(q_row + half[None, :], o1, mask=q_mask)
    tl.store(q_row + D // 2 + half[None, :], o2, mask=q_mask)
    if APPEND:
        row_in_cache = tl.load(slot_ptr + t).to(tl.int64) * HKV
        k_row = k_out_ptr + (row_in_cache + kv_head)[:, None] * D
        # Each k head's program also moves the matching v head, unrotated.
        v_src = qkv_ptr + t * stride_qkv + (HQ + HKV + kv_head)[:, None] * D
        v_dst = v_cache_ptr + (row_in_cache + kv_head)[:, None] * D
        tl.store(v_dst + half[None, :], tl.load(v_src + half[None, :], mask=k_mask), mask=k_mask)
        tl.store(
            v_dst + D // 2 + half[None, :], tl.load(v_src + D // 2 + half[None, :], mask=k_mask), mask=k_mask
        )
    else:
        k_row = k_out_ptr + t * HKV * D + kv_head[:, None] * D
    tl.store(k_row + half[None, :], o1, mask=k_mask)
    tl.store(k_row + D // 2 + half[None, :], o2, mask=k_mask)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    gemma: bool,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_h: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) * D] (the merged projection) -> q [T, H, D] and k [T, Hkv, D].

    Without `q_weight` and `k_weight` (both None) there are no norms: the rope alone.
    With `kv_cache` = (k_cache, v_cache, slots), caches [num_slots, Hkv, D] (a paged pool viewed by
    token slot) and slots [T] the slot of each token, k and v are written there instead, and the k cache
    is returned in k's place."""
    d = table.shape[1]
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or d % 2:
        raise ValueError("qkv needs a contiguous last dim of (H + 2 Hkv) x the table's rotary width")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q/k norm weights or neither")
    norm = q_weight is not None
    if any(w is not None and w.shape[0] != d for w in (q_weight, k_weight)):
        raise ValueError("the q/k norm weights need the table's rotary width")
    q = torch.empty((tokens, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if kv_cache is None:
        k = torch.empty((tokens, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        v_cache, slots = k, positions  # placeholders: never touched without APPEND
    else:
        k, v_cache, slots = kv_cache
    launch: Any = qk_norm_rope_kernel[(tokens, triton.cdiv(num_heads + num_kv_heads, block_h))]
    launch(
        qkv,
        positions,
        q_weight if norm else qkv,  # placeholders without norms: never read
        k_weight if norm else qkv,
        table,
        q,
        k,
        slots,
        v_cache,
        qkv.stride(0),
        table.stride(0),
        eps,
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        BLOCK_H=block_h,
        GEMMA=gemma,
        APPEND=kv_cache is not None,
        NORM=norm,
    )
    return q, k
