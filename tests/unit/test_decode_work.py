"""Issue 6: the one-launch decode's work lists (engine/attention/decode_work.py), on the host: every row's
earlier tokens are covered by its items' chunks exactly once, the list fits its capacity, rows come longest
first, and graphs of up to 32 rows keep equal shares."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem.engine.attention.decode_work import (
    EQUAL_SHARES_MAX_BS,
    WORK_WAVES,
    plan_work,
    work_capacity,
    work_launch,
)


def covered(work: torch.Tensor, old: list[int], capacity: int) -> dict[int, list[tuple[int, int]]]:
    """Row -> the token ranges of its items, as the kernel derives them (chunk index x chunk)."""
    chunk = int(work[-1])
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, split in zip(work[:capacity].tolist(), work[capacity : 2 * capacity].tolist()):
        if row >= 0:
            lo = split * chunk
            spans.setdefault(row, []).append((lo, min(lo + chunk, old[row])))
    return spans


@pytest.mark.parametrize("seed", range(6))
def test_items_cover_every_row_once_within_capacity(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(33, 257, (1,), generator=g))
    old = torch.randint(0, 2500, (rows,), generator=g)
    old[: rows // 8] = 0  # padding rows of a decode graph: no earlier token
    capacity = work_capacity(rows, 8, 132, 16)
    work = plan_work(old.to(torch.int32), capacity, 64, 128)
    assert work.dtype == torch.int32 and work.shape == (2 * capacity + 1,)
    chunk = int(work[-1])
    assert chunk % 64 == 0 and chunk >= 128
    assert int(old.sum()) <= chunk * (capacity - rows), "a chunk of total / spare items always fits"
    listed = int((work[:capacity] >= 0).sum())
    assert work[:listed].ge(0).all() and work[listed:capacity].eq(-1).all(), "idle items come last"
    spans = covered(work, old.tolist(), capacity)
    assert sorted(spans) == list(range(rows)), "every row has an item"
    for row, ranges in spans.items():
        n = int(old[row])
        assert len(ranges) == max(1, -(-n // chunk)), row  # what the kernel counts as the row's items
        assert ranges == sorted(ranges) and ranges[0][0] == 0 and ranges[-1][1] == n, row
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), row  # contiguous, no overlap
    runs = [row for row, _ in itertools.groupby(work[:listed].tolist())]
    assert len(runs) == rows, "each row's items sit together (the kernel finds them from the first)"
    assert [int(old[r]) for r in runs] == sorted(old.tolist(), reverse=True), "longest rows first"


def test_one_item_per_row_when_the_spare_room_allows_only_long_chunks() -> None:
    work = plan_work(torch.tensor([5, 70, 33], dtype=torch.int32), 4, 16, 16)
    assert work.tolist() == [1, 2, 0, -1, 0, 0, 0, -1, 112]


def test_capacity_must_leave_room_and_small_graphs_keep_equal_shares() -> None:
    with pytest.raises(ValueError, match="leave no room"):
        plan_work(torch.tensor([10, 20], dtype=torch.int32), 2, 16, 16)
    assert work_launch(EQUAL_SHARES_MAX_BS, 8, 132) is None
    launch = work_launch(EQUAL_SHARES_MAX_BS + 1, 8, 132)
    assert launch is not None and launch.items == work_capacity(EQUAL_SHARES_MAX_BS + 1, 8, 132, WORK_WAVES)
    assert work_capacity(256, 8, 132, 16) == 256 + 264
