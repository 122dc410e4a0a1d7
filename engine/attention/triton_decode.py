"""Small-batch decode in one Triton launch: the q/k norms (where the model has them) and rope of the new
token, its K/V store, paged attention split over the KV, and the merge of the splits.

Why: at a few rows, the step from the q/k/v projection to the o projection was three kernels a layer (the
rope with the K/V store, flashinfer's decode and its split-KV merge), each mostly launch and ramp, for far
less KV than the time they take could read. Here program (row, KV head, split) does all of it in one
launch (timed against the three in benchmarks/results/kernel-choices-decode-fused.json):
- it rotates its query heads and the new key in registers; split 0 also writes the new K/V to the pool;
- it attends over its share of the row's earlier tokens with an online softmax (scores and the P·V product
  on tensor cores, the query group padded to 16 rows). Split 0 adds the new token from registers, so no
  program reads a slot this launch writes;
- it writes its partial output and log-sum-exp, then takes a ticket. The program that takes the last ticket
  of its (row, KV head) merges the splits and sets the ticket back to zero, ready for the next launch or
  CUDA-graph replay.

Its building blocks are in triton_decode_blocks.py.

Rows are flashinfer's CSR page lists (the decode graphs' own buffers), plus per row the number of earlier
tokens and the new token's slot (`FlashInferBackend`'s plan coordinates). No sliding window and no
soft-cap: those layers keep flashinfer. Numerics follow the unfused chain: each norm rounds once to bf16,
the rope rotates in float32 and rounds q and k to bf16, and attention accumulates in float32.

Triton ships with CUDA builds of torch; this module is imported only on CUDA, never on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_decode_blocks import attend_share, split_epilogue
from tandem.engine.layers.pdl import pdl_launch

_LOG2E = 1.4426950408889634
MIN_GROUP_ROWS = 16  # tl.dot's smallest M: query groups are padded to it


@triton.jit
def decode_rope_attention_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    qkv_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    table_ptr,
    k_cache_ptr,
    v_cache_ptr,
    indptr_ptr,
    indices_ptr,
    old_ptr,
    slot_ptr,
    part_o_ptr,
    part_lse_ptr,
    tickets_ptr,
    out_ptr,
    stride_qkv,
    stride_table,
    eps,
    qk_scale,  # the softmax scale times log2(e): scores go through exp2
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two: the partials' rows
    GROUP_PAD: tl.constexpr,  # GROUP_P2, at least 16: the tensor-core tiles' rows
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    half = tl.arange(0, D // 2)
    # Before the wait (PDL): what was written before the graph began (positions, page lists, lengths) and
    # the rope table, never the q/k/v projection's output.
    pos = tl.load(pos_ptr + b)
    cos = tl.load(table_ptr + pos * stride_table + half)
    sin = tl.load(table_ptr + pos * stride_table + D // 2 + half)
    slot = tl.load(slot_ptr + b).to(tl.int64) * HKV + h
    # This program's block-aligned share of the row's earlier tokens.
    start_page = tl.load(indptr_ptr + b)
    old = tl.load(old_ptr + b)
    share = tl.cdiv(tl.cdiv(old, SPLITS), BLOCK_N) * BLOCK_N
    lo = s * share
    hi = tl.minimum(lo + share, old)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m, acc, total = attend_share(
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
        s == 0,
        HQ,
        HKV,
        D,
        PAGE,
        GROUP,
        GROUP_PAD,
        BLOCK_N,
        NORM,
        GEMMA,
    )
    split_epilogue(
        m, acc, total, part_o_ptr, part_lse_ptr, tickets_ptr, out_ptr, b, h, s,
        HQ, HKV, D, GROUP, GROUP_P2, GROUP_PAD, SPLITS,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeScratch:
    """Fixed-address scratch for the (row, KV head, split) partials of up to `max_bs` rows and
    `max_row_splits` rows x splits, so graphs can capture it."""

    part_o: torch.Tensor  # float32 [rows * group_p2, head_dim]
    part_lse: torch.Tensor  # float32 [rows * group_p2]
    tickets: torch.Tensor  # int32 [max_bs * num_kv_heads], zero between launches

    @classmethod
    def allocate(
        cls,
        *,
        max_bs: int,
        max_row_splits: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: Any,
    ) -> DecodeScratch:
        rows = max_row_splits * num_kv_heads * triton.next_power_of_2(num_heads // num_kv_heads)
        return cls(
            torch.empty(rows, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.zeros(max_bs * num_kv_heads, dtype=torch.int32, device=device),
        )


def launch_config(batch: int, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(splits per (row, KV head), tokens per block) for a decode graph of `batch` rows, as tuned by
    kernel_choices.py's decode_fused part (Llama-3.1-8B heads at 512 tokens of context, Qwen3-0.6B's at 1024).
    Up to about a quarter of the SMs' worth of (row, head) pairs, one wave of programs (128 at batch 1 to 4
    with 8 KV heads) beat more splits; beyond, about four waves (batch 8 to 64), so that no program walks a
    long row alone. Blocks of 64 tokens beat 32 except where 16 splits leave each program about 32 tokens
    (batch 1 at 512; at 4096 tokens 64 would win there too)."""
    pairs = batch * num_kv_heads
    programs = num_sms if 4 * pairs <= num_sms else 4 * num_sms
    splits = 1
    while splits * 2 <= 16 and pairs * splits * 2 <= programs:
        splits *= 2
    return splits, 32 if splits >= 16 else 64


def decode_rope_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    pages: tuple[torch.Tensor, torch.Tensor],
    old_lens: torch.Tensor,
    slots: torch.Tensor,
    scratch: DecodeScratch,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    gemma: bool,
    scale: float,
    page_size: int,
    splits: int,
    block_n: int = 32,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode token per row: qkv [B, (H + 2 Hkv) * D] (the merged projection, before norms and rope)
    -> attention output [B, H * D].

    `caches` (k, v) are [num_slots, Hkv, D] views of the paged pool; `pages` (indptr [B + 1], indices) list
    each row's pages; `old_lens` [B] counts each row's tokens before the new one; `slots` [B] is the new
    token's flat slot. Without `q_weight` and `k_weight` there are no norms.

    `pdl`: a programmatic dependent launch (engine/layers/pdl.py): each program reads the positions, page
    lists and lengths before it waits for the q/k/v projection. (Loading its first block of K/V before the
    wait too, and each next block one ahead, gained nothing at batch 1 to 4 and lost at 8, so it does not.)"""
    d = table.shape[1]
    batch = qkv.shape[0]
    group = num_heads // num_kv_heads
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or d & (d - 1):
        raise ValueError("qkv needs a contiguous last dim of (H + 2 Hkv) x a power-of-two head_dim")
    if num_heads % num_kv_heads or splits & (splits - 1):
        raise ValueError("needs whole query groups and a power-of-two split count")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q/k norm weights or neither")
    k_cache, v_cache = caches
    indptr, indices = pages
    group_p2 = triton.next_power_of_2(group)
    if batch * splits * num_kv_heads * group_p2 > scratch.part_lse.shape[0]:
        raise ValueError(f"the scratch holds fewer partials than {batch} rows x {splits} splits need")
    if out is None:
        out = torch.empty(batch, num_heads * d, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None
    grid = (batch, num_kv_heads, splits)
    launch: Any = decode_rope_attention_kernel[grid]
    launch(
        qkv,
        positions,
        q_weight if norm else qkv,  # placeholders without norms: never read
        k_weight if norm else qkv,
        table,
        k_cache,
        v_cache,
        indptr,
        indices,
        old_lens,
        slots,
        scratch.part_o,
        scratch.part_lse,
        scratch.tickets,
        out,
        qkv.stride(0),
        table.stride(0),
        eps,
        scale * _LOG2E,
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        PAGE=page_size,
        GROUP=group,
        GROUP_P2=group_p2,
        GROUP_PAD=max(MIN_GROUP_ROWS, group_p2),
        SPLITS=splits,
        BLOCK_N=block_n,
        NORM=norm,
        GEMMA=gemma,
        num_warps=num_warps,
        **pdl_launch(pdl),
    )
    return out
