"""CSR page lists for paged-attention kernels, skipping pages the sliding window has evicted.

Row b reads logical pages [kv_start[b] // page_size, ceil(seq_len[b] / page_size)) of its page table.
Entries below kv_start are stale (those pages may already belong to someone else), and leaving them
out is what saves the reads: a window mask alone would still load every page in the list. Positions
stay correct because the kernels only use relative positions: with queries at the end of each row's
KV, key j of the trimmed list is at absolute position kv_start + j.

Everything here runs on the host, with numpy, from the host copies of the batch: the planner needs
the layout on the CPU anyway, and the page lists cost microseconds here where gathering them on the
device cost a dozen tiny kernels in front of every decode graph. The backend sends them over in one
copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
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


def paged_layout(seq_lens: torch.Tensor, kv_start: torch.Tensor, page_size: int) -> PagedLayout:
    """Host page counts per row: every row keeps at least its newest token, so never zero pages."""
    seq = seq_lens.numpy().astype(np.int64)
    first = kv_start.numpy().astype(np.int64) // page_size
    end = (seq + page_size - 1) // page_size
    counts = end - first
    if bool((counts < 1).any()):
        raise ValueError("every row needs at least one live KV page (kv_start must be below seq_len)")
    indptr = np.zeros(seq.shape[0] + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = seq - (end - 1) * page_size
    return PagedLayout(torch.from_numpy(indptr), _int32(last), _int32(seq - first * page_size))


def _int32(array: npt.NDArray[np.int64]) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.int32))


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


def page_indices(
    page_table: torch.Tensor, kv_start: torch.Tensor, layout: PagedLayout, page_size: int
) -> torch.Tensor:
    """The live physical pages of every row, concatenated (host int32), from the host page table.

    Built on the host with numpy: a handful of microseconds, where the same gather on the device is
    about fifteen tiny kernels between two decode steps.
    """
    indptr = layout.indptr.numpy().astype(np.int64)
    counts = np.diff(indptr)
    first = kv_start.numpy().astype(np.int64) // page_size
    row_of = np.repeat(np.arange(counts.shape[0]), counts)
    col = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1] - first, counts)
    return torch.from_numpy(page_table.numpy()[row_of, col].astype(np.int32))


def append_coordinates(kv_lens: torch.Tensor, extend_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and position (within the row's listed KV) of every new token, host int32 [T] each: row b
    appends its extend_lens[b] tokens at the end of its kv_lens[b] listed tokens."""
    ext = extend_lens.numpy().astype(np.int64)
    rows = np.repeat(np.arange(ext.shape[0]), ext)
    first = kv_lens.numpy().astype(np.int64) - ext  # position of each row's first new token
    offsets = np.arange(rows.shape[0]) - np.repeat(np.cumsum(ext) - ext, ext)
    positions = first[rows] + offsets
    return torch.from_numpy(rows.astype(np.int32)), torch.from_numpy(positions.astype(np.int32))


def decode_slots(layout: PagedLayout, indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The flat pool slot of each decode row's new token, host int32 [B]: the last token of the row's
    listed KV, in its last listed page. int32 is ample: a pool of 2**31 token slots would need more
    than 512 GB per layer."""
    last_page = indices.numpy().astype(np.int64)[layout.indptr.numpy().astype(np.int64)[1:] - 1]
    return _int32(last_page * page_size + layout.last_page_len.numpy().astype(np.int64) - 1)
