"""Physical KV page allocation.

Every TP rank runs the same scheduler code on the same inputs, so allocation must be
a pure function of the call history: no sets are iterated and no clocks are read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["OutOfPages", "PageAllocator"]


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Free list of physical page ids [0, num_pages) for one KV group.

    Invariants: every id is either in the free queue exactly once (and flagged free) or
    owned by a caller; ``num_free == len(free queue)``. Freed pages go to the back of the
    queue and allocations take from the front (FIFO), which delays reuse of just-freed
    pages so a stale reference shows up as wrong data rather than silently aliasing the
    most recent allocation.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        # O(1) double-free detection; the deque alone would need a scan.
        self._is_free = bytearray(b"\x01" * num_pages)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages but only {len(self._free)} of {self._num_pages} are free")
        free, is_free = self._free, self._is_free
        out = [free.popleft() for _ in range(n)]
        for p in out:
            is_free[p] = 0
        return out

    def free(self, pages: Sequence[int]) -> None:
        # Validate everything before mutating so a bad call leaves the allocator intact.
        seen: set[int] = set()  # membership only, never iterated
        for p in pages:
            if not 0 <= p < self._num_pages:
                raise ValueError(f"page id {p} out of range [0, {self._num_pages})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(pages)
