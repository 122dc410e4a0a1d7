"""Radix prefix cache for models with sliding-window layers (after SGLang's SWA radix tree).

A cached path keeps full-attention KV for every token, but window KV is only worth keeping where a
later prompt can end a match: a request resuming at position `m` reads window keys in
`[m - window + 1, m)` only. So window pages are tombstoned node by node, apart from the full pages,
and a match is cut back to the longest whole-page prefix whose last `window - 1` tokens still have
window KV. A request hands its prompt to the tree once the prefill is computed, with window KV along
the whole prompt (`windows/prefix.py`), so a later prompt that branches anywhere inside it finds the
window KV at the branch point; the tree tombstones the old window pages least recently used first
when a pool runs short.

Determinism (every TP rank must evict the same pages): children live in insertion-ordered dicts,
recency is a logical tick, and heap ties are broken by a node's creation id.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tandem.scheduler.pages import PageAllocator
from tandem.scheduler.windows.nodes import (
    MISSING,
    WindowMatch,
    WindowNode,
    first_window_page,
    run_end,
    usable_end,
)

__all__ = ["MISSING", "WindowMatch", "WindowNode", "WindowRadixCache"]


class WindowRadixCache:
    """Page-granular radix tree over the pages of several KV groups, some with a window.

    Invariants: ``cached_pages(g)`` counts group g's pages in the tree; ``evictable_pages(g)`` those
    that eviction may free: for a full group, pages of nodes with ``lock_ref == 0``; for a window
    group, pages of live nodes with ``win_lock_ref == 0``. A lock pins full pages along its whole path
    and window pages from its window's first page on, and a node boundary is made there when locking,
    so splits never move pages in or out of a lock. A tombstoned unlocked leaf serves no match and is
    dropped at once. Both heaps hold candidates lazily: stale entries are skipped or re-pushed.
    """

    def __init__(self, page_size: int, allocators: Sequence[PageAllocator], windows: Sequence[int | None]):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if len(allocators) != len(windows) or all(w is None for w in windows):
            raise ValueError("a window cache needs one allocator per group and at least one window")
        self.page_size = page_size
        self._allocators = list(allocators)
        self._full = [g for g, w in enumerate(windows) if w is None]
        self._windowed = [g for g, w in enumerate(windows) if w is not None]
        self._window = max(w for w in windows if w is not None)
        self._next_id = 1
        self._tick = 0
        self._root = WindowNode(0, (), [[] for _ in windows], True, None)
        self._num_nodes = 0
        self._cached = [0] * len(windows)
        self._evictable = [0] * len(windows)
        self._num_locks = 0
        self._leaf_heap: list[tuple[int, int, WindowNode]] = []  # LRU unlocked leaves (full eviction)
        self._win_heap: list[tuple[int, int, WindowNode]] = []  # LRU live nodes without a window lock
        self._heap_slack = 64
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- counters ----------------------------------------------------------------------------
    def cached_pages(self, group: int) -> int:
        return self._cached[group]

    def evictable_pages(self, group: int) -> int:
        return self._evictable[group]

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # ---- match -------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], *, count: bool = True) -> WindowMatch:
        """The longest whole-page prefix cached with window KV for its last window; marks it used and
        splits the node it ends in, so the handle covers exactly the match. Lock it before anything
        else can evict. With `count=False` the hit counters wait for `record_query`."""
        ps = self.page_size
        tokens = tuple(token_ids)
        path = self._descend(tokens)  # (node, pages of it matched)
        live = [n.live for n, k in path for _ in range(k)]
        end = usable_end(live, ps, self._window)
        self._tick += 1
        pages: list[list[int]] = [[] for _ in self._cached]
        node, pos = self._root, 0
        for child, _ in path:
            if pos == end:
                break
            take = min(len(child.key) // ps, end - pos)
            if take * ps < len(child.key):
                child = self._split(child, take * ps)
            child.last_access = self._tick
            for g, out in enumerate(pages):
                out.extend(child.pages[g] if child.pages[g] or g in self._full else [MISSING] * take)
            node, pos = child, pos + take
        if count:
            self.record_query(len(tokens), end * ps)
        return WindowMatch(end * ps, pages, node)

    def covered(self, token_ids: Sequence[int]) -> int:
        """How many whole pages of `token_ids` the tree holds, window KV or not."""
        return sum(k for _, k in self._descend(tuple(token_ids)))

    def _descend(self, tokens: tuple[int, ...]) -> list[tuple[WindowNode, int]]:
        """The nodes along `tokens` with how many whole pages of each match (the last may be partial)."""
        path: list[tuple[WindowNode, int]] = []
        node, pos = self._root, 0
        while (step := self._next(node, tokens, pos)) is not None:
            child, k = step
            path.append(step)
            if k * self.page_size < len(child.key):
                break
            node, pos = child, pos + k
        return path

    def _next(self, node: WindowNode, tokens: tuple[int, ...], pos: int) -> tuple[WindowNode, int] | None:
        """The child of `node` that continues `tokens` from page `pos`, and its pages that match."""
        ps = self.page_size
        at = pos * ps
        limit = len(tokens) - len(tokens) % ps
        child = node.children.get(tokens[at : at + ps]) if at < limit else None
        if child is None:
            return None
        n = min(len(child.key), limit - at)
        if child.key[:n] != tokens[at : at + n]:
            n = next(i for i in range(n) if child.key[i] != tokens[at + i])  # >= ps: the first page matched
        return child, n // ps

    def _first_window_page(self, end_pages: int) -> int:
        return first_window_page(end_pages, self.page_size, self._window)

    # ---- insert ------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: Sequence[Sequence[int]]) -> None:
        """Cache ``token_ids`` with ``pages[g]`` per group (``MISSING`` where a window group's page is
        gone). The tree takes every page given: it adopts those it lacks (reviving tombstoned window
        pages where the caller holds them in every window group), keeps its own where it has them, and
        frees the caller's duplicates. The caller must not use any of them afterwards."""
        ps = self.page_size
        tokens = tuple(token_ids)
        total = len(tokens) // ps
        if len(tokens) % ps or any(len(p) != total for p in pages):
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {[len(p) for p in pages]}")
        held = [all(pages[g][i] != MISSING for g in self._windowed) for i in range(total)]
        self._tick += 1
        dropped: list[list[int]] = [[] for _ in pages]
        node, pos = self._root, 0
        while (step := self._next(node, tokens, pos)) is not None:
            child, k = step
            if not child.live:  # revive runs the caller holds; split where that changes
                k = run_end(held, pos, pos + k) - pos
            if k * ps < len(child.key):
                child = self._split(child, k * ps)
            self._merge(child, pages, pos, held[pos], dropped)
            child.last_access = self._tick
            node, pos = child, pos + k
        while pos < total:
            stop = run_end(held, pos, total)
            own = [list(p[pos:stop]) if held[pos] or g in self._full else [] for g, p in enumerate(pages)]
            for g in self._windowed:
                dropped[g].extend(p for p in pages[g][pos:stop] if not own[g] and p != MISSING)
            node, pos = self._add(node, tokens[pos * ps : stop * ps], own, held[pos]), stop
        self._drop_useless(node, dropped)  # if it ends in a tombstoned leaf, nothing live is below it
        self._free(dropped)

    def _merge(
        self, node: WindowNode, pages: Sequence[Sequence[int]], pos: int, held: bool, dropped: list[list[int]]
    ) -> None:
        n = len(node.key) // self.page_size
        revive = held and not node.live
        for g, theirs in enumerate(pages):
            if revive and g in self._windowed:
                node.pages[g] = list(theirs[pos : pos + n])
                self._cached[g] += n
                self._evictable[g] += n  # a tombstoned node holds no window lock
                continue
            mine = node.pages[g]
            for i, p in enumerate(theirs[pos : pos + n]):
                if p != MISSING and (not mine or mine[i] != p):
                    dropped[g].append(p)
        if revive:
            node.live = True
            self._push(self._win_heap, node)

    def _add(
        self, parent: WindowNode, key: tuple[int, ...], pages: list[list[int]], live: bool
    ) -> WindowNode:
        for g, own in enumerate(pages):
            self._cached[g] += len(own)
            self._evictable[g] += len(own)
        node = WindowNode(self._next_id, key, pages, live, parent)
        self._next_id += 1
        node.last_access = self._tick
        parent.children[key[: self.page_size]] = node
        self._num_nodes += 1
        self._push(self._leaf_heap, node)
        if live:
            self._push(self._win_heap, node)
        return node

    # ---- locks -------------------------------------------------------------------------------
    def lock(self, handle: WindowNode) -> None:
        if handle.detached:
            raise ValueError("lock on an evicted node; lock right after match_prefix")
        self._num_locks += 1
        path, depth = self._path(handle)
        lo = self._first_window_page(depth // self.page_size) * self.page_size
        start = depth
        for node in path:  # from the handle up
            end, start = start, start - len(node.key)
            if start < lo < end:  # the upper half stays outside the window lock
                self._add_lock(self._split(node, lo - start), 1, window=False)
                self._add_lock(node, 1, window=True)
            else:
                self._add_lock(node, 1, window=start >= lo)

    def unlock(self, handle: WindowNode) -> None:
        if self._num_locks == 0 or (handle is not self._root and handle.lock_ref == 0):
            raise ValueError("unlock of a node that is not locked")
        self._num_locks -= 1
        path, depth = self._path(handle)
        lo = self._first_window_page(depth // self.page_size) * self.page_size
        start = depth
        for node in path:
            start -= len(node.key)
            self._add_lock(node, -1, window=start >= lo)

    def _add_lock(self, node: WindowNode, step: int, window: bool) -> None:
        ps = self.page_size
        if node.lock_ref == (0 if step > 0 else 1):  # 0 -> 1 or 1 -> 0
            for g in self._full:
                self._evictable[g] -= step * len(node.pages[g])
        node.lock_ref += step
        if node.lock_ref == 0 and not node.children:
            self._push(self._leaf_heap, node)
        if not window:
            return
        if step > 0 and not node.live:
            raise AssertionError("window lock on a tombstoned node")
        if node.win_lock_ref == (0 if step > 0 else 1):
            for g in self._windowed:
                self._evictable[g] -= step * (len(node.key) // ps)
        node.win_lock_ref += step
        if node.win_lock_ref == 0:
            self._push(self._win_heap, node)

    def _path(self, handle: WindowNode) -> tuple[list[WindowNode], int]:
        path, depth = [], 0
        node: WindowNode | None = handle
        while node is not None and node is not self._root:
            path.append(node)
            depth += len(node.key)
            node = node.parent
        return path, depth

    # ---- eviction ----------------------------------------------------------------------------
    def evict(self, group: int, num_pages: int) -> int:
        """Free at least ``num_pages`` of ``group``'s pages if that many are evictable; return how
        many of that group were freed. Full groups trim LRU unlocked leaves from their tail (their
        window pages go with them); window groups tombstone LRU nodes' window pages."""
        freed: list[list[int]] = [[] for _ in self._cached]
        full = group in self._full
        heap = self._leaf_heap if full else self._win_heap
        while len(freed[group]) < num_pages and heap:
            access, _, node = heapq.heappop(heap)
            if not (self._leaf_candidate(node) if full else self._win_candidate(node)):
                continue
            if access != node.last_access:
                self._push(heap, node)  # used since it was queued: requeue at its real age
                continue
            if full:
                self._trim(node, num_pages - len(freed[group]), freed)
            else:
                self._tombstone(node, freed)
        self._free(freed)
        return len(freed[group])

    def _trim(self, node: WindowNode, want: int, freed: list[list[int]]) -> None:
        ps = self.page_size
        n = len(node.key) // ps
        keep = max(0, n - want)
        for g, pages in enumerate(node.pages):
            gone = pages[keep:] if pages else []
            freed[g].extend(gone)
            self._cached[g] -= len(gone)
            self._evictable[g] -= len(gone)
            node.pages[g] = pages[:keep] if pages else []
        if keep:
            node.key = node.key[: keep * ps]
            self._push(self._leaf_heap, node)
            self._drop_useless(node, freed)
        else:
            parent = node.parent
            self._detach(node)
            assert parent is not None
            self._drop_useless(parent, freed)

    def _tombstone(self, node: WindowNode, freed: list[list[int]]) -> None:
        for g in self._windowed:
            freed[g].extend(node.pages[g])
            self._cached[g] -= len(node.pages[g])
            self._evictable[g] -= len(node.pages[g])
            node.pages[g] = []
        node.live = False
        if not node.children and node.lock_ref == 0:
            self._drop_useless(node, freed)

    def _drop_useless(self, node: WindowNode, freed: list[list[int]]) -> None:
        """Drop a tombstoned unlocked leaf, and any ancestors that become one: no match can end there."""
        current: WindowNode | None = node
        while current is not None and current is not self._root:
            if current.live or current.children or current.lock_ref:
                break
            for g in self._full:
                freed[g].extend(current.pages[g])
                self._cached[g] -= len(current.pages[g])
                self._evictable[g] -= len(current.pages[g])
            parent = current.parent
            self._detach(current)
            current = parent

    def _detach(self, node: WindowNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size]]
        node.detached, node.parent = True, None
        self._num_nodes -= 1
        if self._leaf_candidate(parent):
            self._push(self._leaf_heap, parent)

    def _leaf_candidate(self, node: WindowNode) -> bool:
        return node is not self._root and not node.detached and not node.children and node.lock_ref == 0

    def _win_candidate(self, node: WindowNode) -> bool:
        return node is not self._root and not node.detached and node.live and node.win_lock_ref == 0

    # ---- structure ---------------------------------------------------------------------------
    def _split(self, node: WindowNode, n: int) -> WindowNode:
        # The lower half keeps the node's identity (handles to it keep their path); the upper half
        # inherits both lock counts, since every lock through the node also runs through it.
        assert node.parent is not None
        ps = self.page_size
        k = n // ps
        upper = WindowNode(self._next_id, node.key[:n], [p[:k] for p in node.pages], node.live, node.parent)
        self._next_id += 1
        upper.lock_ref, upper.win_lock_ref = node.lock_ref, node.win_lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[n:], [p[k:] for p in node.pages], upper
        upper.children[node.key[:ps]] = node
        self._num_nodes += 1
        if upper.live and upper.win_lock_ref == 0:
            self._push(self._win_heap, upper)
        return upper

    def _free(self, pages: list[list[int]]) -> None:
        for g, group_pages in enumerate(pages):
            if group_pages:
                self._allocators[g].free(group_pages)

    def _push(self, heap: list[tuple[int, int, WindowNode]], node: WindowNode) -> None:
        heapq.heappush(heap, (node.last_access, node.node_id, node))
        if len(heap) > 2 * self._num_nodes + self._heap_slack:  # stale entries dominate: rebuild
            keep = self._leaf_candidate if heap is self._leaf_heap else self._win_candidate
            heap[:] = [(n.last_access, n.node_id, n) for n in self.nodes() if keep(n)]
            heapq.heapify(heap)

    def nodes(self) -> list[WindowNode]:
        out: list[WindowNode] = []
        stack = list(reversed(self._root.children.values()))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(n.children.values()))
        return out
