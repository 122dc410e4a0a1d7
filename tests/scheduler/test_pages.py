"""The page allocator: exact counts, FIFO reuse that delays just-freed pages, clear errors on exhaustion,
double frees and bad ids, and the same pages from every instance."""

import pytest

from tandem.scheduler.pages import OutOfPages, PageAllocator


def test_alloc_and_free_counts() -> None:
    a = PageAllocator(8)
    assert (a.num_pages, a.num_free) == (8, 8)
    assert a.alloc(0) == []
    got = a.alloc(3)
    assert got == [0, 1, 2]
    assert a.num_free == 5
    a.free(got)
    assert a.num_free == 8


def test_fifo_reuse_delays_just_freed_pages() -> None:
    a = PageAllocator(4)
    first = a.alloc(2)
    a.free(first)
    # The never-used pages come out before the ones that were just freed.
    assert a.alloc(4) == [2, 3, 0, 1]


def test_out_of_pages_message() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPages, match=r"requested 2 pages but only 1 of 4"):
        a.alloc(2)
    assert a.num_free == 1  # a failed alloc takes nothing
    assert issubclass(OutOfPages, RuntimeError)


def test_negative_alloc_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).alloc(-1)


def test_double_free_and_bad_ids() -> None:
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([4])
    with pytest.raises(ValueError, match="out of range"):
        a.free([-1])
    # Failed frees are atomic: page 1 is still allocated and can be freed once.
    assert a.num_free == 3
    a.free([pages[1]])
    assert a.num_free == 4


def test_deterministic_across_instances() -> None:
    def run() -> list[int]:
        a = PageAllocator(16)
        x, y = a.alloc(5), a.alloc(3)
        a.free(y)
        a.free(x[1:3])
        return a.alloc(12)

    assert run() == run()
