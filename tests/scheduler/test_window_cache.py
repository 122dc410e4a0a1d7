"""The window-aware radix cache: a match needs window KV for its last window, window pages are tombstoned
apart from full pages, locks pin what their holder reads, both kinds of eviction, and page accounting
under random operations."""

from __future__ import annotations

import random

import pytest

from tandem.scheduler.pages import PageAllocator
from tandem.scheduler.windows.tree import MISSING, WindowRadixCache

PS, WINDOW = 4, 8
FULL, WIN = 0, 1


def make(
    windows: tuple[int | None, ...] = (None, WINDOW), num_pages: int = 64
) -> tuple[WindowRadixCache, list[PageAllocator]]:
    allocs = [PageAllocator(num_pages) for _ in windows]
    return WindowRadixCache(PS, allocs, windows), allocs


def put(
    cache: WindowRadixCache, allocs: list[PageAllocator], tokens: list[int], dead: int = 0
) -> list[list[int]]:
    """Insert `tokens` as a finished request would: every full page, window pages past the first `dead`."""
    n = len(tokens) // PS
    pages = []
    for g, alloc in enumerate(allocs):
        windowed = g != FULL or len(allocs) == 1
        pages.append([MISSING] * dead + alloc.alloc(n - dead) if windowed else alloc.alloc(n))
    cache.insert(tokens, pages)
    return pages


def free_counts(allocs: list[PageAllocator]) -> list[int]:
    return [a.num_free for a in allocs]


def test_a_match_needs_window_kv_for_its_last_window() -> None:
    cache, allocs = make()
    tokens = list(range(40))
    pages = put(cache, allocs, tokens, dead=6)  # window KV only for tokens 24..39
    m = cache.match_prefix([*tokens, 99])
    # A query at 40 reads window keys 33..39: pages 8 and 9, both live.
    assert m.num_tokens == 40
    assert m.pages == [pages[FULL], [MISSING] * 6 + pages[WIN][6:]]
    # Ending at 32 needs keys 25..31 (pages 6, 7): live. Ending at 28 needs 21..27: page 5 is dead.
    assert cache.match_prefix([*tokens[:32], 7]).num_tokens == 32
    assert cache.match_prefix([*tokens[:28], 7, 7, 7, 7]).num_tokens == 0
    assert cache.match_prefix(tokens[:31]).num_tokens == 0  # 28 is the longest whole-page prefix
    assert (cache.hit_tokens, cache.query_tokens) == (72, 41 + 33 + 32 + 31)


def test_a_match_through_a_tombstoned_node_is_cut_back() -> None:
    cache, allocs = make()
    x = list(range(48))
    put(cache, allocs, x[:24])
    put(cache, allocs, x[:40], dead=6)  # [24, 40) joins under [0, 24)
    put(cache, allocs, x, dead=10)  # and [40, 48) under it
    deep = cache.match_prefix([*x, 1])
    cache.lock(deep.handle)  # window-locks [40, 48) only: a query at 48 reads from 41
    cache.match_prefix([*x[:24], 5])  # [0, 24) is now the most recent
    before = free_counts(allocs)
    assert cache.evict(WIN, 1) == 4  # tombstones the least recent unlocked window node, [24, 40)
    assert free_counts(allocs) == [before[FULL], before[WIN] + 4]
    # Ending at 36, 32 or 28 needs window pages in [24, 40); ending at 24 needs pages 4 and 5.
    assert cache.match_prefix([*x[:36], 9]).num_tokens == 24
    assert cache.match_prefix([*x, 1]).num_tokens == 48  # the locked tail is intact
    cache.unlock(deep.handle)


def test_tombstoning_an_unlocked_leaf_drops_it_with_its_full_pages() -> None:
    cache, allocs = make()
    put(cache, allocs, list(range(16)))
    assert [cache.cached_pages(g) for g in (FULL, WIN)] == [4, 4]
    assert cache.evict(WIN, 1) == 4
    assert [cache.cached_pages(g) for g in (FULL, WIN)] == [0, 0]  # no match could end there
    assert free_counts(allocs) == [64, 64] and cache.nodes() == []


def test_a_lock_pins_full_pages_and_only_its_window() -> None:
    cache, allocs = make()
    tokens = list(range(24))
    put(cache, allocs, tokens)
    m = cache.match_prefix([*tokens, 0])
    cache.lock(m.handle)
    # Full pages of the whole path are pinned; window pages from the first one a query at 24 reads (17).
    assert [cache.evictable_pages(g) for g in (FULL, WIN)] == [0, 4]
    assert cache.evict(FULL, 10) == 0
    assert cache.evict(WIN, 10) == 4  # the path's older window pages go; the window stays
    assert cache.match_prefix([*tokens, 0]).num_tokens == 24
    cache.unlock(m.handle)
    assert [cache.evictable_pages(g) for g in (FULL, WIN)] == [6, 2]
    assert cache.evict(FULL, 6) == 6
    assert free_counts(allocs) == [64, 64] and cache.nodes() == []


def test_full_eviction_trims_the_lru_leaf_and_its_window_pages() -> None:
    cache, allocs = make()
    put(cache, allocs, list(range(16)))
    put(cache, allocs, [100 + t for t in range(16)])
    cache.match_prefix(list(range(17)))  # the first path is now the most recent
    assert cache.evict(FULL, 1) == 1  # the second path's last page, in both groups
    assert free_counts(allocs) == [57, 57]
    assert cache.match_prefix([100 + t for t in range(16)]).num_tokens == 12


def test_an_insert_revives_tombstoned_window_pages_and_frees_duplicates() -> None:
    cache, allocs = make()
    tokens = list(range(32))
    put(cache, allocs, tokens, dead=6)
    assert cache.match_prefix([*tokens[:16], 1]).num_tokens == 0
    put(cache, allocs, tokens, dead=2)  # a second request held window pages from 8 on
    # Its full pages and its window pages 6, 7 duplicate the tree's and are freed; 2..5 are adopted.
    assert [cache.cached_pages(g) for g in (FULL, WIN)] == [8, 6]
    assert free_counts(allocs) == [56, 58]
    assert cache.match_prefix([*tokens[:16], 1]).num_tokens == 16
    assert cache.match_prefix([*tokens[:8], 1]).num_tokens == 0


def test_all_window_groups_mistral() -> None:
    """Every layer windowed: a tombstoned node holds no pages at all, and dead ends are dropped."""
    cache, allocs = make(windows=(WINDOW,))
    tokens = list(range(32))
    put(cache, allocs, tokens, dead=5)
    assert cache.cached_pages(0) == 3
    assert cache.match_prefix([*tokens, 0]).num_tokens == 32
    assert cache.evict(0, 1) == 3
    assert cache.nodes() == [] and free_counts(allocs) == [64]


@pytest.mark.parametrize("windows", [(None, WINDOW), (WINDOW,), (None, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_page_accounted(windows: tuple[int | None, ...], seed: int) -> None:
    """Inserts of shared and diverging paths with random window losses, locks, unlocks and both kinds of
    eviction: every page is free, in the tree, or held by a caller; counters match the tree; a locked
    match's full pages and window pages are never freed and still match."""
    rng = random.Random(seed)
    cache, allocs = make(windows, num_pages=400)
    stems = [[rng.randrange(6) for _ in range(rng.randrange(1, 12) * PS)] for _ in range(4)]
    locked: list[tuple[list[int], list[list[int]], object]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(stems)[: rng.randrange(1, 12) * PS] + [rng.randrange(3)] * PS * rng.randrange(
                3
            )
            n = len(tokens) // PS
            if n and all(a.num_free >= n for a in allocs):
                put(cache, allocs, tokens[: n * PS], dead=rng.randrange(n))
        elif op < 0.65:
            query = rng.choice(stems)[: rng.randrange(1, 12) * PS] + [0]
            m = cache.match_prefix(query)
            if m.num_tokens:
                cache.lock(m.handle)
                locked.append((query[: m.num_tokens], m.pages, m.handle))
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked)))[2])  # type: ignore[arg-type]
        else:
            group = rng.randrange(len(windows))
            want = rng.randrange(1, 10)
            evictable = cache.evictable_pages(group)
            freed = cache.evict(group, want)
            assert freed >= min(want, evictable)
        _check(cache, allocs, windows)
        for tokens, pages, _ in locked:
            again = cache.match_prefix([*tokens, 0], count=False)
            assert again.num_tokens >= len(tokens)  # never lost while locked
            # Full pages of the whole match and window pages of its last window are the ones locked.
            widest = max(w for w in windows if w is not None)
            lo = max(0, len(tokens) - widest + 1) // PS
            for g, group_pages in enumerate(pages):
                first = 0 if windows[g] is None else lo
                assert again.pages[g][first : len(group_pages)] == group_pages[first:]
                assert MISSING not in group_pages[first:]
    for _, _, handle in locked:
        cache.unlock(handle)  # type: ignore[arg-type]
    for g in range(len(windows)):
        cache.evict(g, 1000)
    assert cache.nodes() == [] and free_counts(allocs) == [400] * len(windows)


def _check(cache: WindowRadixCache, allocs: list[PageAllocator], windows: tuple[int | None, ...]) -> None:
    nodes = cache.nodes()
    for g, alloc in enumerate(allocs):
        owned = [p for n in nodes for p in n.pages[g]]
        assert len(owned) == len(set(owned)) == cache.cached_pages(g)
        assert not any(alloc._is_free[p] for p in owned)
        if windows[g] is None:
            evictable = sum(len(n.pages[g]) for n in nodes if n.lock_ref == 0)
        else:
            evictable = sum(len(n.pages[g]) for n in nodes if n.live and n.win_lock_ref == 0)
        assert evictable == cache.evictable_pages(g)
    for n in nodes:
        assert n.lock_ref >= n.win_lock_ref
        assert all(c.lock_ref <= n.lock_ref for c in n.children.values())
        assert n.live or n.win_lock_ref == 0
