"""The window tree's nodes and matches, and which pages a query reads through a window."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MISSING", "WindowMatch", "WindowNode", "first_window_page", "run_end", "usable_end"]

MISSING = -1  # a window page the inserting request no longer holds


@dataclass(eq=False, slots=True)
class WindowNode:
    """One edge of the tree. ``pages[g]`` holds group g's pages for ``key`` (``len(key) // page_size``
    of them), except a window group's list is empty while the node is tombstoned (``live`` false).
    ``lock_ref`` pins every page of the node; ``win_lock_ref`` counts the locks that also need its
    window pages, which pins them against tombstoning."""

    node_id: int
    key: tuple[int, ...]
    pages: list[list[int]]
    live: bool
    parent: WindowNode | None
    children: dict[tuple[int, ...], WindowNode] = field(default_factory=dict)
    lock_ref: int = 0
    win_lock_ref: int = 0
    last_access: int = 0
    detached: bool = False


@dataclass(frozen=True)
class WindowMatch:
    """A usable cached prefix: ``pages[g]`` for every group, window groups holding ``MISSING`` where the
    tree has no window KV (only below the match's last window). ``handle`` goes to ``lock``/``unlock``."""

    num_tokens: int
    pages: list[list[int]]
    handle: WindowNode


def first_window_page(end_pages: int, page_size: int, window: int) -> int:
    """First page a query at token `end_pages * page_size` reads through its window."""
    return max(0, end_pages * page_size - window + 1) // page_size


def usable_end(live: list[bool], page_size: int, window: int) -> int:
    """Largest page count `e` whose window pages `[first_window_page(e), e)` are all live."""
    dead_before = [0]
    for ok in live:
        dead_before.append(dead_before[-1] + (not ok))
    for end in range(len(live), 0, -1):
        lo = first_window_page(end, page_size, window)
        if dead_before[end] == dead_before[lo]:
            return end
    return 0


def run_end(held: list[bool], start: int, stop: int) -> int:
    """End of the run of equal `held` values from `start`, at most `stop`."""
    end = start + 1
    while end < stop and held[end] == held[start]:
        end += 1
    return end
