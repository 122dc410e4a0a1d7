"""The sampler's exponential race (sampler.py) in one pass over the logits, for every row of a batch,
seeded or not: the draw the engine makes on CUDA for batches without penalties, top-k, top-p or min-p.

Why: at batch 256 and Qwen3's 151,936-token vocabulary the flashinfer path costs three passes after the LM
head (the logits to float32, the division by the temperature and flashinfer's draw), and a batch with any
seeded row took the much slower torch hash race instead
(benchmarks/results/kernel-choices-sampling-slices.json). Here each program reads a slice of one row's
logits in their own dtype once, divides by the row's temperature, subtracts the row's counter-based noise
(the same hash of seed, step and vocab index as `log_exponential_noise`; the vocab index's own hash comes
from the `vocab_keys` table) and keeps the running argmax. Each program then takes a ticket, and the one
that takes a row's last ticket picks the row's winner among its slices: one launch per batch, since the
host's per-launch cost is a visible share of a small model's step. Rows with temperature below
`GREEDY_EPS` take the plain argmax, as in `Sampler._draw`.
Structured-output rows branch to a loop that reads their bitmask a block of words at a time; the other
rows of a masked launch run the plain loop, so sharing a launch with constrained rows costs them nothing.

The draw is exact, like the torch race: argmax(logit / T - log E) with E ~ Exp(1) is a sample from
softmax(logit / T), and it depends only on the row's seed and step, so every TP rank draws the same
token. In Triton's CPU interpreter it picks the torch race's token (tests/kernels/test_triton_sample.py);
on a GPU `log` rounds differently, so near-ties may go the other way. Triton ships with CUDA builds of
torch; this module is imported only on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.sampler import GREEDY_EPS

# Programs per launch to aim for: slices per row are about this / batch, a power of 2 in [1, 64]. Eight
# four-warp programs per SM (of 132), enough loads in flight to cover memory latency: at two per SM,
# batch 256 ran one slice per row and took 1.6x as long as with 8 slices
# (benchmarks/results/kernel-choices-sampling-slices.json).
_TARGET_PROGRAMS = 1056


@triton.jit
def _mix32(x):  # type: ignore[no-untyped-def]  # Wellons' lowbias32 on uint32, wrapping as intended
    x ^= x >> 16
    x *= tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full(x.shape, 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _race_values(logits_ptr, row_base, vocab_key_ptr, v, inside, key, divisor, noise_scale):  # type: ignore[no-untyped-def]
    """logit / T - log E at the columns `v` (any shape), -inf outside the vocabulary."""
    logit = tl.load(logits_ptr + row_base + v, mask=inside, other=float("-inf"))
    # The column's half of the key is the same for every row: a table, read from L2 after the first rows.
    column = tl.load(vocab_key_ptr + v, mask=inside, other=0).to(tl.uint32, bitcast=True)
    bits = _mix32(key ^ column)
    # u = (2j + 1) / 2^24 from the top 24 bits: exact in float32, strictly inside (0, 1).
    u = ((bits >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)
    log_e = tl.log(-tl.log(u))
    return tl.where(inside, logit.to(tl.float32) / divisor - noise_scale * log_e, float("-inf"))


@triton.jit
def _race_plain(  # type: ignore[no-untyped-def]  # pointers and constexprs
    logits_ptr,
    row_base,
    vocab_key_ptr,
    key,
    divisor,
    noise_scale,
    start,
    vocab,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """(best value, its lowest index) over one slice of an unconstrained row."""
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), 2147483647, tl.int32)
    for b in range(0, BLOCKS):
        v = start + b * BLOCK + tl.arange(0, BLOCK)
        value = _race_values(logits_ptr, row_base, vocab_key_ptr, v, v < vocab, key, divisor, noise_scale)
        better = value > best_val  # strict: a lane keeps its earliest index on ties
        best_val = tl.where(better, value, best_val)
        best_idx = tl.where(better, v, best_idx)
    top = tl.max(best_val, axis=0)
    return top, tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)


@triton.jit
def _race_masked(  # type: ignore[no-untyped-def]  # pointers and constexprs
    logits_ptr,
    row_base,
    vocab_key_ptr,
    key,
    divisor,
    noise_scale,
    start,
    vocab,
    mask_base,
    limit,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The same over one slice of a constrained row, as [words, 32] tiles: each block's bitmask words are
    one contiguous load, and bit j of word i speaks for column 32 i + j of the tile. Ids from `limit` on
    are never allowed."""
    WORDS: tl.constexpr = BLOCK // 32
    word_of = tl.arange(0, WORDS)
    bit = tl.arange(0, 32)[None, :]
    best_val = tl.full((WORDS, 32), float("-inf"), tl.float32)
    best_idx = tl.full((WORDS, 32), 2147483647, tl.int32)
    for b in range(0, BLOCKS):
        first_word = (start + b * BLOCK) // 32  # blocks start on a word: BLOCK is a multiple of 32
        words = first_word + word_of
        word = tl.load(mask_base + words, mask=words * 32 < limit, other=0)
        v = words[:, None] * 32 + bit
        allowed = (v < limit) & (((word[:, None] >> bit) & 1) != 0)
        value = _race_values(logits_ptr, row_base, vocab_key_ptr, v, v < vocab, key, divisor, noise_scale)
        value = tl.where(allowed, value, float("-inf"))
        better = value > best_val
        best_val = tl.where(better, value, best_val)
        best_idx = tl.where(better, v, best_idx)
    top = tl.max(tl.max(best_val, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=1), axis=0)
    return top, first


# The mask's sizes vary by batch and tokenizer: specialized, each new value could build a variant mid-run.
@triton.jit(do_not_specialize=["masked_rows", "mask_stride", "mask_vocab"])
def race_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    step_ptr,
    vocab_key_ptr,
    best_val_ptr,
    best_idx_ptr,
    tickets_ptr,  # int32 [B]: zero between launches
    out_ptr,
    mask_ptr,  # int32 [G, mask_stride]: xgrammar's packed bitmasks (MASKED)
    mask_rows_ptr,  # int64 [G]: the batch row of each bitmask row (MASKED)
    stride_row,
    vocab,
    slices,
    greedy_eps,
    masked_rows,
    mask_stride,
    mask_vocab,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,  # per slice; a constant so the loop has a fixed trip count
    MASKED: tl.constexpr,
    SLICES: tl.constexpr,  # `slices` rounded up to a power of two
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    step = tl.load(step_ptr + row).to(tl.int64)
    # The row key, as log_exponential_noise builds it: step, then the seed's high and low words.
    one = tl.full((1,), 0, tl.uint32)
    key = _mix32(one + ((step & 0xFFFFFFFF) ^ 0x9E3779B9).to(tl.uint32))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < greedy_eps
    divisor = tl.where(greedy, 1.0, temperature)
    noise_scale = tl.where(greedy, 0.0, 1.0)
    start = part * (BLOCK * BLOCKS)
    row_base = row * stride_row
    if MASKED:
        # This row's bitmask row (-1: unconstrained), by a scan of the (at most a batch of) listed rows,
        # from L2 after the first program.
        mask_row = tl.full([], -1, tl.int32)
        for i in range(0, masked_rows, 64):
            lane = i + tl.arange(0, 64)
            listed = tl.load(mask_rows_ptr + lane, mask=lane < masked_rows, other=-1)
            mask_row = tl.maximum(mask_row, tl.max(tl.where(listed == row, lane, -1), axis=0))
        # A branch, not a select: unconstrained rows run the plain loop, with none of the mask's work.
        if mask_row >= 0:
            mask_base = mask_ptr + mask_row.to(tl.int64) * mask_stride
            top, first = _race_masked(
                logits_ptr,
                row_base,
                vocab_key_ptr,
                key,
                divisor,
                noise_scale,
                start,
                vocab,
                mask_base,
                mask_vocab,
                BLOCK,
                BLOCKS,
            )
        else:
            top, first = _race_plain(
                logits_ptr, row_base, vocab_key_ptr, key, divisor, noise_scale, start, vocab, BLOCK, BLOCKS
            )
    else:
        top, first = _race_plain(
            logits_ptr, row_base, vocab_key_ptr, key, divisor, noise_scale, start, vocab, BLOCK, BLOCKS
        )
    if SLICES == 1:
        _store_token(out_ptr + row, first)
    else:
        tl.store(best_val_ptr + row * slices + part, top)
        tl.store(best_idx_ptr + row * slices + part, first)
        # Every thread's stores come before the ticket (the barrier); the ticket releases them.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel")
        if ticket == slices - 1:
            lane = tl.arange(0, SLICES)
            valid = lane < slices
            # .cg: from L2, where the other programs' stores are, not a stale L1 line.
            at = row * slices + lane
            val = tl.load(best_val_ptr + at, mask=valid, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(best_idx_ptr + at, mask=valid, other=2147483647, cache_modifier=".cg")
            best = tl.max(val, axis=0)
            # Slices are in vocab order, so the lowest index among the tied maxima is torch.argmax's answer.
            _store_token(out_ptr + row, tl.min(tl.where(val == best, idx, 2147483647), axis=0))
            tl.atomic_xchg(tickets_ptr + row, 0)  # ready for the next launch


@triton.jit
def _store_token(dst, first):  # type: ignore[no-untyped-def]
    # A row with nothing above -inf (or only NaN) keeps no index: 0, as torch.argmax of all -inf gives.
    tl.store(dst, tl.where(first == 2147483647, 0, first).to(tl.int64))


def race_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    columns: torch.Tensor,
    *,
    vocab_size: int | None = None,
    block: int = 1024,
    slices: int | None = None,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
    bitmask_vocab: int | None = None,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [B]: per row, argmax(logits / T - log E(seed, step, v)) over the first `vocab_size`
    columns; the plain argmax where T < GREEDY_EPS. logits [B, V'] in any float dtype (rows may be
    strided, V' >= vocab_size), temperature float32 [B], seeds and steps int64 [B], `columns` from
    `sampler.race_keys(vocab_size)`.

    `bitmask` int32 [G, W] (xgrammar's packing) constrains the batch rows `bitmask_rows` (int64 [G]):
    their tokens with a clear bit, and ids from `bitmask_vocab` on, are never drawn; a row left with
    nothing drawable gets 0, as for all -inf logits.

    `tickets` int32 [>= B], zero, and left zero: the slices' meeting point, kept by the caller so a launch
    needs no fill (a fresh one is made without it). Launches sharing it must be ordered (one stream)."""
    rows = logits.shape[0]
    vocab = vocab_size or logits.shape[1]
    if logits.stride(1) != 1 or vocab > logits.shape[1]:
        raise ValueError("logits need a contiguous last dim holding at least vocab_size columns")
    if columns.dtype != torch.int32 or columns.shape[0] < vocab:
        raise ValueError("columns must be sampler.race_keys(vocab_size): int32, one key per column")
    if slices is None:
        # Powers of two: each slice count is a compiled variant (the blocks per slice are a constant).
        slices = min(64, triton.next_power_of_2(-(-_TARGET_PROGRAMS // max(rows, 1))))
    blocks = -(-vocab // block)
    per_slice = -(-blocks // min(slices, blocks))
    slices = -(-blocks // per_slice)
    best_val = torch.empty((rows, slices), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if tickets is None:
        tickets = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    elif tickets.dtype != torch.int32 or tickets.shape[0] < rows:
        raise ValueError(f"tickets must be int32 with at least {rows} entries")
    masked = bitmask is not None
    if masked != (bitmask_rows is not None):
        raise ValueError("give the bitmask and its batch rows together")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.stride(1) != 1):
        raise ValueError("the bitmask must be int32 with a contiguous last dim (xgrammar's)")
    mask_vocab = min(bitmask_vocab or vocab, vocab)
    if masked and block % 32:
        raise ValueError(
            f"a masked race reads whole bitmask words per block: block {block} is not a multiple of 32"
        )
    if bitmask is not None and 32 * bitmask.shape[1] < mask_vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot speak for {mask_vocab} ids")
    kernel: Any = race_kernel[(rows, slices)]
    kernel(
        logits,
        temperature,
        seeds,
        steps,
        columns,
        best_val,
        best_idx,
        tickets,
        out,
        bitmask if bitmask is not None else best_idx,  # placeholders unmasked: never read
        bitmask_rows if bitmask_rows is not None else seeds,
        logits.stride(0),
        vocab,
        slices,
        GREEDY_EPS,
        0 if bitmask_rows is None else bitmask_rows.shape[0],
        0 if bitmask is None else bitmask.stride(0),
        mask_vocab,
        BLOCK=block,
        BLOCKS=per_slice,
        MASKED=masked,
        SLICES=triton.next_power_of_2(slices),
    )
    return out
