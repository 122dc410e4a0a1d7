"""CSR page lists for paged-attention kernels, skipping pages the sliding window has evicted.

Row b reads logical pages [kv_start[b] // page_size, ceil(seq_len[b] / page_size)) of its page table.
Entries below kv_start are stale (those pages may already belong to someone else), and leaving them
out is what saves the reads: a window mask alone would still load every page in the list. Positions
stay correct because the kernels only use relative positions: with queries at the end of each row's
KV, key j of the trimmed list is at absolute position kv_start + j.

The host half (`paged_layout`) is what a planner needs on the CPU; the page indices themselves are
gathered on the device (`kv_page_indices`) from the device page table, with the output size taken
from the host, so nothing waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedLayout:
    """Host int32 tensors describing B rows of paged KV."""

    indptr: torch.Tensor  # [B + 1]: row b's pages are indices[indptr[b]:indptr[b + 1]]
    last_page_len: torch.Tensor  # [B], in [1, page_size]: live tokens in each row's last page
    kv_lens: torch.Tensor  # [B]: live KV tokens per row (seq_len - kv_start)

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.shape[0])

    def pin(self) -> PagedLayout:
        """Pinned copies, so the planners' host-to-device copies are truly asynchronous."""
        return PagedLayout(
            self.indptr.pin_memory(), self.last_page_len.pin_memory(), self.kv_lens.pin_memory()
        )


def paged_layout(seq_lens: torch.Tensor, kv_start: torch.Tensor, page_size: int) -> PagedLayout:
    """Host page counts per row: every row keeps at least its newest token, so never zero pages."""
    seq = seq_lens.to(torch.int32)
    first = kv_start.to(torch.int32) // page_size
    end = (seq + page_size - 1) // page_size
    counts = end - first
    if bool((counts < 1).any()):
        raise ValueError("every row needs at least one live KV page (kv_start must be below seq_len)")
    indptr = torch.zeros(seq.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0)
    last = seq - (end - 1) * page_size
    return PagedLayout(indptr, last.to(torch.int32), (seq - first * page_size).to(torch.int32))


def empty_layout() -> PagedLayout:
    """No rows; `pad_layout(empty_layout(), n)` is n padding rows (CUDA-graph capture)."""
    none = torch.zeros(0, dtype=torch.int32)
    return PagedLayout(torch.zeros(1, dtype=torch.int32), none, none)


def pad_layout(layout: PagedLayout, batch_size: int) -> PagedLayout:
    """Append rows of one page holding one token, up to `batch_size` rows (CUDA-graph padding).

    The caller points those pages at a dummy page that no request owns.
    """
    pad = batch_size - layout.batch_size
    if pad < 0:
        raise ValueError(f"cannot pad {layout.batch_size} rows down to {batch_size}")
    if pad == 0:
        return layout
    tail = layout.indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)
    ones = torch.ones(pad, dtype=torch.int32)
    return PagedLayout(
        torch.cat([layout.indptr, tail]),
        torch.cat([layout.last_page_len, ones]),
        torch.cat([layout.kv_lens, ones]),
    )


def kv_page_indices(
    page_table: torch.Tensor,
    kv_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
) -> torch.Tensor:
    """The live physical pages of every row, concatenated (int32, on page_table's device).

    `num_pages` must equal `paged_layout(...).num_pages`: passing it from the host is what lets
    `repeat_interleave` size its output without reading the device.
    """
    device = page_table.device
    first = (kv_start.to(torch.int64) // page_size).to(device)
    counts = (seq_lens.to(device=device, dtype=torch.int64) + page_size - 1) // page_size - first
    rows = torch.arange(counts.shape[0], device=device)
    row_of = torch.repeat_interleave(rows, counts, output_size=num_pages)
    row_begin = torch.cumsum(counts, 0) - counts
    col = torch.arange(num_pages, device=device) - row_begin[row_of] + first[row_of]
    return page_table[row_of, col].to(torch.int32)


def append_coordinates(kv_lens: torch.Tensor, extend_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and position (within the row's listed KV) of every new token, host int32 [T] each: row b
    appends its extend_lens[b] tokens at the end of its kv_lens[b] listed tokens."""
    ext = extend_lens.numpy().astype(np.int64)
    rows = np.repeat(np.arange(ext.shape[0]), ext)
    first = kv_lens.numpy().astype(np.int64) - ext  # position of each row's first new token
    offsets = np.arange(rows.shape[0]) - np.repeat(np.cumsum(ext) - ext, ext)
    positions = first[rows] + offsets
    return torch.from_numpy(rows.astype(np.int32)), torch.from_numpy(positions.astype(np.int32))
