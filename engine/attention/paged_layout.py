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


@dataclass(frozen=True)
class DecodeGraphMeta:
    """A decode graph's page lists, padded to its batch size (host int32 numpy): padding rows list one
    page, the caller's dummy page, holding one token."""

    indptr: npt.NDArray[np.int32]  # [bs + 1]
    last_page_len: npt.NDArray[np.int32]  # [bs]
    # [2, bs]: row 0 each new token's position in its row's listed KV (the append kernel's), row 1 its
    # flat pool slot: the last token of the row's last listed page.
    coords: npt.NDArray[np.int32]
    indices: npt.NDArray[np.int32]  # [indptr[-1]]

    @classmethod
    def empty(cls, batch_size: int, capacity: int) -> DecodeGraphMeta:
        return cls(
            np.empty(batch_size + 1, dtype=np.int32),
            np.empty(batch_size, dtype=np.int32),
            np.empty((2, batch_size), dtype=np.int32),
            np.empty(capacity, dtype=np.int32),
        )


def decode_graph_meta(
    seq_lens: npt.NDArray[np.integer],
    kv_start: npt.NDArray[np.integer] | None,
    page_table: npt.NDArray[np.int32],
    batch_size: int,
    dummy_page: int,
    page_size: int,
    out: DecodeGraphMeta,
) -> DecodeGraphMeta:
    """Write the page lists of a decode batch (host arrays: its rows' lengths, first live tokens and
    page-table rows) into `out`, padded to `batch_size` rows; return the filled views of `out` (whose
    arrays may be longer: a staging buffer sized for the largest graph). `kv_start` None: a group that
    never evicts (every row's pages from its first).

    It runs before every decode step, so it is a few whole-array numpy ops into `out`, with no arrays
    per row and nothing kept. int32 throughout: a pool of 2**31 token slots would need more than 512 GB
    per layer."""
    real = seq_lens.shape[0]
    pad = batch_size - real
    if pad < 0:
        raise ValueError(f"cannot pad {real} rows down to {batch_size}")
    indptr, last = out.indptr[: batch_size + 1], out.last_page_len[:batch_size]
    coords, pages = out.coords[:, :batch_size], out.indices
    indptr[0] = 0
    listed = 0
    if real:
        seq = seq_lens.astype(np.int32, copy=False)
        end = (seq + (page_size - 1)) // page_size
        columns = np.arange(page_table.shape[1], dtype=np.int32)
        live = columns < end[:, None]
        if kv_start is None:
            np.cumsum(end, out=indptr[1 : real + 1])
            coords[0, :real] = seq - 1
        else:
            first = kv_start.astype(np.int32, copy=False) // page_size
            if int((end - first).min()) < 1:
                raise ValueError("every row needs at least one live KV page (kv_start must be below seq_len)")
            np.cumsum(end - first, out=indptr[1 : real + 1])
            live &= columns >= first[:, None]
            coords[0, :real] = seq - first * page_size - 1
        listed = int(indptr[real])
        pages[:listed] = page_table[live]  # row-major: row by row, page by page, the CSR order
        last[:real] = seq - (end - 1) * page_size
        coords[1, :real] = pages[indptr[1 : real + 1] - 1] * page_size + (last[:real] - 1)
    if pad:  # rows of the graph past the batch: one token on the dummy page each
        indptr[real + 1 :] = np.arange(listed + 1, listed + pad + 1, dtype=np.int32)
        pages[listed : listed + pad] = dummy_page
        last[real:] = 1
        coords[0, real:] = 0
        coords[1, real:] = dummy_page * page_size  # the dummy page's first slot
    return DecodeGraphMeta(indptr, last, coords, pages[: listed + pad])
