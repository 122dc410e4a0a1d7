"""Work lists for the one-launch decode at large batch (triton_decode.py, `work=`): programs (KV head, item)
over (row, chunk) items, so that rows of very different lengths get programs in proportion to their length.
Host-side and Triton-free: the decode graphs' plan builds the list, and CPU tests check it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Graphs of more rows than this take work lists; up to it, equal shares of each row (launch_config).
EQUAL_SHARES_MAX_BS = 32
WORK_WAVES = 4  # programs per SM beyond one per (row, KV head)
WORK_BLOCK_N = 64
WORK_MIN_CHUNK = 128


@dataclass(frozen=True)
class WorkLaunch:
    """How a decode graph above EQUAL_SHARES_MAX_BS rows splits its rows' KV: `items` work items of
    `min_chunk` tokens or more (a multiple of `block_n`)."""

    items: int
    block_n: int
    min_chunk: int


def work_launch(batch: int, num_kv_heads: int, num_sms: int) -> WorkLaunch | None:
    """The work list's shape for a graph of `batch` rows, or None: equal shares at this size."""
    if batch <= EQUAL_SHARES_MAX_BS:
        return None
    return WorkLaunch(work_capacity(batch, num_kv_heads, num_sms, WORK_WAVES), WORK_BLOCK_N, WORK_MIN_CHUNK)


def work_capacity(batch: int, num_kv_heads: int, num_sms: int, waves: int) -> int:
    """Work items for a decode graph of `batch` rows: one per row, plus enough chunks of the longer rows
    for about `waves` programs per SM over the KV heads."""
    return batch + -(-waves * num_sms // num_kv_heads)


def plan_work(old_lens: torch.Tensor, capacity: int, block_n: int, min_chunk: int) -> torch.Tensor:
    """The work list for `decode_rope_attention(work=)`: host int32 [2 * capacity + 1], the items' rows
    (-1 past the list), their chunk index within the row, and the chunk's tokens.

    Each row needs ceil(old / chunk) items (one at least), which is at most old / chunk + 1, so a chunk of
    total / (capacity - rows) tokens or more always fits every row in `capacity` items; the chunk is that,
    rounded up to a multiple of `block_n`, and at least `min_chunk`. Rows go longest first, so the last
    programs to start are the shortest (the longest-processing-time order)."""
    old = old_lens.to(torch.int64)
    rows = old.shape[0]
    if capacity <= rows:
        raise ValueError(f"{capacity} work items leave no room to split {rows} rows")
    spare = capacity - rows
    chunk = max(min_chunk, -(-int(old.sum()) // spare))
    chunk = -(-chunk // block_n) * block_n
    order = torch.argsort(old, descending=True, stable=True)
    counts = ((old[order] + chunk - 1) // chunk).clamp_(min=1)
    listed = int(counts.sum())
    items = torch.repeat_interleave(order, counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    work = torch.full((2 * capacity + 1,), -1, dtype=torch.int32)
    work[:listed] = items
    work[capacity : capacity + listed] = torch.arange(listed) - starts
    work[-1] = chunk
    return work
