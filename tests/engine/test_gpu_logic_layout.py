"""The GPU path, checked on CPU: the paged-KV page lists the flashinfer backend plans from, and its
kernel params."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.engine.attention.base import LayerSpec
from tandem.engine.attention.kernel_params import GroupKernel, group_kernels
from tandem.engine.attention.paged_layout import (
    DecodeGraphMeta,
    append_coordinates,
    decode_graph_meta,
    page_indices,
    paged_layout,
)
from tandem.engine.kv_pool import KVGroupSpec, KVPool


def reference_pages(table: torch.Tensor, kv_start: list[int], seq: list[int], ps: int) -> list[list[int]]:
    return [table[b, s // ps : -(-n // ps)].tolist() for b, (s, n) in enumerate(zip(kv_start, seq))]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_lists_skip_evicted_pages(page_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    seq = [1, 5, 16, 17, 64, 33]
    # Window-evicted rows start at a page boundary below their newest token.
    kv_start = [
        0,
        0,
        0,
        16 // page_size * page_size,
        40 // page_size * page_size,
        32 // page_size * page_size,
    ]
    width = max(-(-n // page_size) for n in seq)
    table = torch.randint(0, 1000, (len(seq), width), generator=g, dtype=torch.int32)
    layout = paged_layout(
        torch.tensor(seq, dtype=torch.int32), torch.tensor(kv_start, dtype=torch.int32), page_size
    )
    ref = reference_pages(table, kv_start, seq, page_size)
    assert layout.indptr.tolist() == [0, *torch.tensor([len(r) for r in ref]).cumsum(0).tolist()]
    assert layout.num_pages == sum(len(r) for r in ref)
    for b, n in enumerate(seq):
        assert 1 <= int(layout.last_page_len[b]) <= page_size
        # The listed pages hold exactly the live tokens.
        assert (len(ref[b]) - 1) * page_size + int(layout.last_page_len[b]) == n - kv_start[b]
        assert int(layout.kv_lens[b]) == n - kv_start[b]
    indices = page_indices(table, torch.tensor(kv_start, dtype=torch.int32), layout, page_size)
    assert indices.dtype == torch.int32
    assert indices.tolist() == [p for r in ref for p in r]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_append_coordinates_address_the_new_tokens_slots(page_size: int) -> None:
    """flashinfer's append kernel puts token (row, pos) at page indices[indptr[row] + pos // ps],
    offset pos % ps. That must be the slot the scheduler allocated for its absolute position, with
    window-evicted pages left out of the lists (mixed prefill, extend and decode rows)."""
    g = torch.Generator().manual_seed(1)
    seq = [7, 40, 33, 1, 64]
    extend = [7, 3, 1, 1, 20]
    kv_start = [0, 16 // page_size * page_size, 24 // page_size * page_size, 0, 32 // page_size * page_size]
    width = max(-(-n // page_size) for n in seq)
    table = torch.randperm(len(seq) * width, generator=g).view(len(seq), width).to(torch.int32)
    seq_t, start_t = torch.tensor(seq, dtype=torch.int32), torch.tensor(kv_start, dtype=torch.int32)
    layout = paged_layout(seq_t, start_t, page_size)
    indices = page_indices(table, start_t, layout, page_size)
    rows, positions = append_coordinates(layout.kv_lens, torch.tensor(extend, dtype=torch.int32))
    assert rows.dtype == positions.dtype == torch.int32
    expected = [
        int(table[b, p // page_size]) * page_size + p % page_size
        for b, (n, e) in enumerate(zip(seq, extend))
        for p in range(n - e, n)
    ]
    got = [
        int(indices[int(layout.indptr[r]) + int(p) // page_size]) * page_size + int(p) % page_size
        for r, p in zip(rows.tolist(), positions.tolist())
    ]
    assert got == expected
    assert all(int(p) < int(layout.kv_lens[r]) for r, p in zip(rows.tolist(), positions.tolist()))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_slots_are_the_new_tokens_slots_and_padding_the_dummy_page(page_size: int) -> None:
    """What a decode graph's q/k/v step stores K/V at: each row's slot for its newest position, as the
    scheduler allocated it, over window-evicted page lists; padding rows at the dummy page's first slot."""
    g = torch.Generator().manual_seed(2)
    seq = [1, 17, 40, 64, 33]
    kv_start = [0, 0, 24 // page_size * page_size, 48 // page_size * page_size, 0]
    width = max(-(-n // page_size) for n in seq)
    table = torch.randperm(len(seq) * width, generator=g).view(len(seq), width).to(torch.int32)
    start_t = torch.tensor(kv_start, dtype=torch.int32)
    layout = paged_layout(torch.tensor(seq, dtype=torch.int32), start_t, page_size)
    dummy = 10_000
    indices = page_indices(table, start_t, layout, page_size)
    bs = len(seq) + 3
    meta = graph_meta(seq, kv_start, table.numpy(), bs, dummy, page_size)
    assert meta.coords.dtype == np.int32
    # The same page lists as the eager plan's (paged_layout, page_indices), padded.
    assert meta.indptr[: len(seq) + 1].tolist() == layout.indptr.tolist()
    assert meta.last_page_len.tolist() == layout.last_page_len.tolist() + [1] * 3
    expected = [
        int(table[b, (n - 1) // page_size]) * page_size + (n - 1) % page_size for b, n in enumerate(seq)
    ]
    assert meta.coords[1].tolist() == expected + [dummy * page_size] * 3
    # Row 0: the new token's index in its row's listed KV (the last one); padding rows' is 0.
    kv_lens = [n - s for n, s in zip(seq, kv_start)]
    assert meta.coords[0].tolist() == [n - 1 for n in kv_lens] + [0] * 3
    assert meta.indices.tolist() == indices.tolist() + [dummy] * 3


def graph_meta(
    seq: list[int], kv_start: list[int], table: np.ndarray, bs: int, dummy: int, page_size: int, room: int = 2
) -> DecodeGraphMeta:
    """`decode_graph_meta` into arrays `room` entries longer than it needs, as a staging buffer sized
    for a larger graph is, filled with -7 so a stray write shows."""
    out = DecodeGraphMeta.empty(bs + room, 1024)
    for array in (out.indptr, out.last_page_len, out.coords, out.indices):
        array.fill(-7)
    seq_a, start_a = np.array(seq, dtype=np.int32), np.array(kv_start, dtype=np.int32)
    meta = decode_graph_meta(seq_a, start_a, table.astype(np.int32), bs, dummy, page_size, out)
    assert out.indptr[bs + 1 :].tolist() == [-7] * room and out.coords[:, bs:].tolist() == [[-7] * room] * 2
    assert out.indices[meta.indices.shape[0]] == -7
    if not any(kv_start):  # a group that never evicts may say so: the same lists
        first = [
            meta.indptr.tolist(),
            meta.last_page_len.tolist(),
            meta.coords.tolist(),
            meta.indices.tolist(),
        ]
        again = decode_graph_meta(seq_a, None, table.astype(np.int32), bs, dummy, page_size, out)
        lists = [
            again.indptr.tolist(),
            again.last_page_len.tolist(),
            again.coords.tolist(),
            again.indices.tolist(),
        ]
        assert lists == first
    return meta


def test_rows_without_live_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="live KV page"):
        paged_layout(torch.tensor([16], dtype=torch.int32), torch.tensor([16], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="live KV page"):
        graph_meta([16], [16], np.zeros((1, 4)), 1, 99, 4)


def test_padding_rows_hold_one_token_on_one_page() -> None:
    table = np.array([[7, 8, 0], [3, 4, 5]])
    padded = graph_meta([5, 9], [0, 0], table, 5, 99, 4)
    assert padded.indptr.tolist() == [0, 2, 5, 6, 7, 8]
    assert padded.last_page_len.tolist() == [1, 1, 1, 1, 1]
    assert padded.indices.tolist() == [7, 8, 3, 4, 5, 99, 99, 99]
    unpadded = graph_meta([5, 9], [0, 0], table, 2, 99, 4)
    assert unpadded.indptr.tolist() == [0, 2, 5] and unpadded.indices.tolist() == [7, 8, 3, 4, 5]
    with pytest.raises(ValueError):
        graph_meta([5, 9], [0, 0], table, 1, 99, 4)
    only_padding = graph_meta([], [], np.zeros((0, 1)), 3, 99, 4)
    assert only_padding.indptr.tolist() == [0, 1, 2, 3] and only_padding.indices.tolist() == [99] * 3
    assert only_padding.coords.tolist() == [[0, 0, 0], [99 * 4] * 3]


def test_pool_has_an_unowned_dummy_page_and_an_nhd_view() -> None:
    groups = [KVGroupSpec(0, (0, 1), None, 8), KVGroupSpec(1, (2,), 32, 5)]
    pool = KVPool(groups, 4, 2, 16, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.dummy_page(0) == 8 and pool.dummy_page(1) == 5
    assert pool.k[0].shape[0] == 9 * 4 and pool.k[2].shape[0] == 6 * 4
    k, v = pool.paged_view(2)
    assert k.shape == (6, 4, 2, 16) and v.shape == (6, 4, 2, 16)
    pool.store(2, torch.tensor([5 * 4 + 3]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    assert float(k[5, 3].sum()) == 32.0  # the view aliases the flat slots


def spec(layer: int, window: int | None, heads: int = 4, softcap: float | None = None) -> LayerSpec:
    return LayerSpec(layer, heads, 2, 16, 0.25, window, softcap)


def test_group_kernel_converts_window_and_softcap() -> None:
    groups = [KVGroupSpec(0, (1,), None, 8), KVGroupSpec(1, (0, 2), 32, 8)]
    kernels = group_kernels(
        groups, [spec(0, 32, softcap=50.0), spec(1, None, softcap=50.0), spec(2, 32, softcap=50.0)]
    )
    assert kernels[0] == GroupKernel(4, 2, 16, 0.25, -1, 50.0)
    # Keys in (q - 32, q] are keys in [q - 31, q]: flashinfer's inclusive window_left is 31.
    assert kernels[1].window_left == 31 and kernels[1].softcap == 50.0
    assert GroupKernel.of([spec(0, None)]).softcap == 0.0


def test_group_kernel_rejects_mixed_layers() -> None:
    with pytest.raises(ValueError, match="disagree"):
        GroupKernel.of([spec(0, None), spec(1, None, heads=8)])
    with pytest.raises(ValueError, match="window"):
        group_kernels([KVGroupSpec(0, (0,), 16, 4)], [spec(0, None)])
