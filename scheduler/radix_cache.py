"""Radix prefix cache over token ids at page granularity.

Determinism matters (every TP rank must evict the same pages): children live in
insertion-ordered dicts, recency is a logical tick rather than wall time, and ties in
the eviction heap are broken by a node's creation id.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .pages import PageAllocator

__all__ = ["PrefixMatch", "RadixCache", "RadixNode"]


class RadixNode:
    """One edge of the tree; opaque to callers, who only pass it back as a handle.

    Invariants: ``len(key) == len(pages) * page_size > 0`` (except the root, which is
    empty); the parent's ``children`` maps ``key[:page_size]`` to this node; ``lock_ref``
    counts the outstanding locks whose path passes through this node.
    """

    __slots__ = ("children", "detached", "key", "last_access", "lock_ref", "node_id", "pages", "parent")

    def __init__(
        self, node_id: int, key: tuple[int, ...], pages: list[int], parent: RadixNode | None
    ) -> None:
        self.node_id = node_id
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.detached = False


@dataclass(frozen=True)
class PrefixMatch:
    """Longest cached whole-page prefix; ``handle`` is what ``lock``/``unlock`` take."""

    num_tokens: int
    pages: list[int]
    handle: RadixNode


class RadixCache:
    """Page-granular radix tree that owns the KV pages of cached prefixes.

    Invariants: ``cached_pages`` is the number of pages in the tree and
    ``evictable_pages`` the number in nodes with ``lock_ref == 0``; a node's
    ``lock_ref`` is never below any child's, so unlocked nodes form subtrees that can be
    evicted leaf-first. Every unlocked leaf has an entry in ``_heap`` carrying its current
    ``last_access``; entries whose node changed since are stale and skipped lazily.
    """

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._page_size = page_size
        self._allocator = allocator
        self._next_id = 1
        self._tick = 0
        self._root = RadixNode(0, (), [], None)
        self._num_nodes = 0
        self._cached = 0
        self._evictable = 0
        self._num_locks = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._heap_slack = 64  # tests shrink it to exercise compaction
        self._hit_tokens = 0
        self._query_tokens = 0

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def hit_tokens(self) -> int:
        return self._hit_tokens

    @property
    def query_tokens(self) -> int:
        return self._query_tokens

    def match_prefix(self, token_ids: Sequence[int], *, count: bool = True) -> PrefixMatch:
        """Find the longest cached whole-page prefix and mark its path recently used.

        Splits a node when the match ends inside it, so the handle covers exactly the
        matched tokens. Lock the handle before anything else can evict or trim it. With
        `count=False` the hit counters wait for `record_query` (a caller that may retry).
        """
        tokens = tuple(token_ids)
        node, matched, pages = self._walk(tokens, collect=True)
        if count:
            self.record_query(len(tokens), matched)
        return PrefixMatch(matched, pages, node)

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``token_ids`` backed by ``pages``; return how many leading tokens were cached.

        The tree adopts ``pages`` only for the part that was not cached yet; the caller
        keeps the rest and must free those that are not the tree's own pages.
        """
        ps = self._page_size
        tokens = tuple(token_ids)
        if len(tokens) % ps or len(tokens) != len(pages) * ps:
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages of {ps}")
        node, matched, _ = self._walk(tokens, collect=False)
        if matched < len(tokens):
            leaf = RadixNode(self._next_id, tokens[matched:], list(pages[matched // ps :]), node)
            self._next_id += 1
            leaf.last_access = self._tick
            node.children[leaf.key[:ps]] = leaf
            self._num_nodes += 1
            self._cached += len(leaf.pages)
            self._evictable += len(leaf.pages)
            self._push(leaf)
        return matched

    def lock(self, handle: RadixNode) -> None:
        if handle.detached:
            raise ValueError("lock on an evicted node; lock right after match_prefix")
        self._num_locks += 1
        node: RadixNode | None = handle
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: RadixNode) -> None:
        if self._num_locks == 0 or (handle is not self._root and handle.lock_ref == 0):
            raise ValueError("unlock of a node that is not locked")
        self._num_locks -= 1
        node: RadixNode | None = handle
        while node is not None and node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from least-recently-used unlocked leaves.

        Leaves are trimmed from their tail, page by page, so exactly ``num_pages`` are
        freed when that many are evictable: the tail of a prompt is its least shared part.
        """
        freed: list[int] = []
        heap = self._heap
        while len(freed) < num_pages and heap:
            access, _, node = heapq.heappop(heap)
            if not self._evictable_leaf(node) or access != node.last_access:
                continue
            take = min(num_pages - len(freed), len(node.pages))
            if take < len(node.pages):
                keep = len(node.pages) - take
                freed.extend(node.pages[keep:])
                node.pages = node.pages[:keep]
                node.key = node.key[: keep * self._page_size]
                self._push(node)
            else:
                freed.extend(node.pages)
                self._detach(node)
            self._cached -= take
            self._evictable -= take
        self._allocator.free(freed)
        return len(freed)

    def reset(self) -> None:
        """Return every cached page to the allocator; only legal with no outstanding locks."""
        if self._num_locks:
            raise RuntimeError(f"reset with {self._num_locks} outstanding lock(s)")
        nodes = self._nodes()
        self._allocator.free([p for n in nodes for p in n.pages])
        for n in nodes:
            n.detached = True
        self._root.children = {}
        self._num_nodes = self._cached = self._evictable = 0
        self._heap = []

    def owned_pages(self) -> list[int]:
        """Debug/test helper: every page the tree owns, in depth-first order."""
        return [p for n in self._nodes() for p in n.pages]

    def _walk(self, tokens: tuple[int, ...], collect: bool) -> tuple[RadixNode, int, list[int]]:
        """Descend along ``tokens`` (splitting where the match ends mid-node) -> (node, length, pages)."""
        ps = self._page_size
        self._tick += 1
        node, pos, pages = self._root, 0, []
        limit = len(tokens) - len(tokens) % ps
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            n = min(len(child.key), limit - pos)
            if child.key[:n] != tokens[pos : pos + n]:
                # The first page matched via the dict key, so n ends up >= ps.
                n = next(i for i in range(n) if child.key[i] != tokens[pos + i])
                n -= n % ps
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            if collect:
                pages.extend(child.pages)
            node, pos = child, pos + n
        if node is not self._root and not node.children:
            self._push(node)
        return node, pos, pages

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        # The lower half keeps the node's identity so outstanding handles to it still
        # denote the same root-to-node token path; the new upper half inherits lock_ref
        # because every lock through the old node also runs through it.
        assert node.parent is not None
        ps = self._page_size
        upper = RadixNode(self._next_id, node.key[:n], node.pages[: n // ps], node.parent)
        self._next_id += 1
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[n:], node.pages[n // ps :], upper
        upper.children[node.key[:ps]] = node
        self._num_nodes += 1
        return upper

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self._page_size]]
        node.detached = True
        node.parent = None
        self._num_nodes -= 1
        if self._evictable_leaf(parent):
            self._push(parent)

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self._root and not node.detached and not node.children and node.lock_ref == 0

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.node_id, node))
        # Lazy invalidation leaves stale entries behind; rebuild before they dominate.
        if len(self._heap) > 2 * self._num_nodes + self._heap_slack:
            self._heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._evictable_leaf(n)]
            heapq.heapify(self._heap)

    def _nodes(self) -> list[RadixNode]:
        out: list[RadixNode] = []
        stack = list(reversed(self._root.children.values()))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(n.children.values()))
        return out
