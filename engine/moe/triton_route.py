"""The router's top-k and the grouping of (token, expert) pairs by expert, in Triton, on the device only.

`route_kernel` runs in parallel over blocks of tokens: the float32 softmax over the experts, the top k
(the tie rule of routing.py: decreasing probability, then the lower expert index), their weights
(renormalized where the model says so), and for each block the count of its pairs per local expert and
each pair's rank among its block's pairs of the same expert.

`align_kernel` is one program that turns those counts into the grouped GEMMs' schedule: each local
expert's pairs laid out contiguously, padded to a multiple of the GEMM's block of rows, the padding slots
holding a sentinel pair id (T * k), the local expert of every block of rows, and the padded total. Every
buffer has its worst-case size, fixed by the token count alone (T * k pairs plus BM - 1 of padding per
expert), and blocks past the total exit at once: no count ever reaches the host, so CUDA graphs capture
the whole of it. Pairs are laid out in pair order within each expert, so the schedule is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def topk_rows(  # type: ignore[no-untyped-def]  # Triton values
    logits_ptr,
    rows,
    row_mask,
    stride_logits,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    R: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr = False,
):
    """(expert ids int32 [R, K_PAD], weights float32 [R, K_PAD]) of the router logits of `rows` ([R]);
    the columns past TOPK are 0. TOPK_SOFTMAX (gpt-oss): the top k logits (same order, same tie rule),
    then a softmax over those k."""
    cols = tl.arange(0, E_PAD)
    real = cols[None, :] < E
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :],
        mask=row_mask[:, None] & real,
        other=0.0,
    ).to(tl.float32)
    x = tl.where(real, x, float("-inf"))
    if TOPK_SOFTMAX:
        # Picked experts become -inf below; padding columns are -inf already and never the best, as
        # at least E - j >= 1 real logits remain at step j.
        p = x
        taken = float("-inf")
    else:
        x = x - tl.max(x, axis=1)[:, None]
        ex = tl.where(real, tl.exp(x), 0.0)
        p = tl.where(real, ex / tl.sum(ex, axis=1)[:, None], -1.0)
        taken = -2.0
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([R, K_PAD], dtype=tl.int32)
    weights = tl.zeros([R, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=1)
        # The lowest index among the experts that share the best probability.
        pick = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), axis=1)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        p = tl.where(cols[None, :] == pick[:, None], taken, p)
    if TOPK_SOFTMAX:  # weights hold the k logits, the largest first
        ex = tl.where(slots[None, :] < TOPK, tl.exp(weights - tl.max(weights, axis=1)[:, None]), 0.0)
        weights = ex / tl.sum(ex, axis=1)[:, None]
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return ids, weights


@triton.jit(do_not_specialize=["num_tokens"])
def route_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    logits_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    ranks_ptr,
    num_tokens,
    stride_logits,
    expert_start,
    num_local,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    BT: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr = False,
    GIVEN: tl.constexpr = False,
):
    """Tokens [b * BT, (b + 1) * BT): ids and weights [T, TOPK]; counts[b, e] for the local experts e;
    ranks[pair] among the block's pairs of the same local expert (-1 for another rank's expert).
    `GIVEN`: ids and weights hold a choice made already (a router these kernels do not implement);
    only the counts and ranks are computed."""
    block = tl.program_id(0)
    rows = block * BT + tl.arange(0, BT)
    row_mask = rows < num_tokens
    slots = tl.arange(0, K_PAD)
    real = row_mask[:, None] & (slots[None, :] < TOPK)
    pairs = rows[:, None] * TOPK + slots[None, :]
    if GIVEN:
        ids = tl.load(ids_ptr + pairs, mask=real, other=0)
    else:
        ids, weights = topk_rows(
            logits_ptr, rows, row_mask, stride_logits, E, E_PAD, TOPK, K_PAD, RENORM, BT, TOPK_SOFTMAX
        )
        tl.store(ids_ptr + pairs, ids, mask=real)
        tl.store(weights_ptr + pairs, weights, mask=real)
    local = ids - expert_start
    local = tl.where(real & (local >= 0) & (local < num_local), local, -1)
    flat = tl.reshape(local, [BT * K_PAD])
    experts = tl.arange(0, LOCAL_PAD)
    onehot = (flat[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + block * num_local + experts, tl.sum(onehot, axis=0), mask=experts < num_local)
    before = tl.cumsum(onehot, axis=0) - onehot
    rank = tl.sum(before * onehot, axis=1)
    rank = tl.where(flat >= 0, rank, -1)
    tl.store(ranks_ptr + tl.reshape(pairs, [BT * K_PAD]), rank, mask=tl.reshape(real, [BT * K_PAD]))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "max_row_blocks"])
def align_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    ids_ptr,
    counts_ptr,
    ranks_ptr,
    sorted_ptr,
    block_experts_ptr,
    total_ptr,
    num_pairs,
    num_blocks,
    max_row_blocks,
    expert_start,
    num_local,
    TOPK: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PAIR_CHUNK: tl.constexpr,
):
    """One program: the padded layout from `route_kernel`'s counts (overwritten with each block's
    first slot per expert), then every local pair scattered to its slot."""
    experts = tl.arange(0, LOCAL_PAD)
    emask = experts < num_local
    chunk = tl.arange(0, CHUNK)
    totals = tl.zeros([LOCAL_PAD], dtype=tl.int32)
    for c in range(0, num_blocks, CHUNK):
        b = c + chunk
        m = (b < num_blocks)[:, None] & emask[None, :]
        totals += tl.sum(tl.load(counts_ptr + b[:, None] * num_local + experts[None, :], mask=m, other=0), 0)
    padded = (totals + BM - 1) // BM * BM
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(total_ptr, tl.sum(padded, axis=0))
    # Each block's first slot per expert: the expert's start plus the pairs of the blocks before it.
    carry = starts
    for c in range(0, num_blocks, CHUNK):
        b = c + chunk
        m = (b < num_blocks)[:, None] & emask[None, :]
        where = counts_ptr + b[:, None] * num_local + experts[None, :]
        counts = tl.load(where, mask=m, other=0)
        tl.store(where, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=m)
        carry += tl.sum(counts, axis=0)
    # The local expert of each block of BM rows: how many experts end at or before the block's first row
    # (empty experts end where they start). Blocks past the total get num_local and are never run.
    ends = tl.where(emask, starts + padded, 2147483647)
    for c in range(0, max_row_blocks, CHUNK):
        m = c + chunk
        first = m * BM
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + m, owner, mask=m < max_row_blocks)
    # The padding slots of each expert hold the sentinel pair id.
    pad = tl.arange(0, BM)
    slot = (starts + totals)[:, None] + pad[None, :]
    tl.store(sorted_ptr + slot, num_pairs, mask=emask[:, None] & (pad[None, :] < (padded - totals)[:, None]))
    # The scatter below reads slots that other threads of this program wrote above: wait for them
    # (a CTA barrier also orders its threads' global memory).
    tl.debug_barrier()
    for c in range(0, num_pairs, PAIR_CHUNK):
        pair = c + tl.arange(0, PAIR_CHUNK)
        live = pair < num_pairs
        expert = tl.load(ids_ptr + pair, mask=live, other=0) - expert_start
        rank = tl.load(ranks_ptr + pair, mask=live, other=-1)
        mine = live & (rank >= 0)
        first = tl.load(counts_ptr + (pair // (TOPK * BT)) * num_local + expert, mask=mine, other=0)
        tl.store(sorted_ptr + first + rank, pair, mask=mine)
