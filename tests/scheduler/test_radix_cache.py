"""The radix prefix cache: whole-page matches and splits, locked pages never evicted, LRU eviction from the
leaves up, and deterministic results."""

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.scheduler.pages import PageAllocator
from tandem.scheduler.radix_cache import PrefixMatch, RadixCache


def make(page_size: int = 4, num_pages: int = 64) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc), alloc


def cached(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    pages = alloc.alloc(len(tokens) // cache.page_size)
    assert cache.insert(tokens, pages) == 0
    return pages


def test_match_on_empty_cache() -> None:
    cache, _ = make()
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert (m.num_tokens, m.pages) == (0, [])
    cache.lock(m.handle)
    cache.unlock(m.handle)
    assert (cache.hit_tokens, cache.query_tokens) == (0, 5)


def test_insert_then_match_full_partial_and_tail() -> None:
    cache, alloc = make()
    pages = cached(cache, alloc, list(range(8)))
    assert cache.match_prefix(list(range(8))).pages == pages
    assert cache.match_prefix([*range(8), 9, 9]).num_tokens == 8
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])  # mismatch in the last page
    assert (m.num_tokens, m.pages) == (4, pages[:1])
    assert cache.match_prefix([0, 1, 2]).num_tokens == 0  # partial pages never match
    assert cache.match_prefix(list(range(7))).num_tokens == 4
    assert (cache.hit_tokens, cache.query_tokens) == (8 + 8 + 4 + 0 + 4, 8 + 10 + 8 + 3 + 7)


def test_page_size_one() -> None:
    cache, alloc = make(page_size=1)
    pages = cached(cache, alloc, [5, 6, 7])
    m = cache.match_prefix([5, 6, 8])
    assert (m.num_tokens, m.pages) == (2, pages[:2])


def test_split_in_the_middle_and_already_cached_count() -> None:
    cache, alloc = make()
    a = cached(cache, alloc, list(range(12)))
    b_tokens = [*range(8), 50, 51, 52, 53, 54, 55, 56, 57]
    b = alloc.alloc(4)
    assert cache.insert(b_tokens, b) == 8
    alloc.free(b[:2])  # duplicates of the tree's first two pages
    assert cache.match_prefix(b_tokens).pages == a[:2] + b[2:]
    assert cache.match_prefix(list(range(12))).pages == a
    assert sorted(cache.owned_pages()) == sorted(a + b[2:])
    assert cache.cached_pages == cache.evictable_pages == 5
    again = alloc.alloc(3)
    assert cache.insert(list(range(12)), again) == 12
    alloc.free(again)
    assert cache.insert([], []) == 0
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [0])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [0, 1])


def test_lock_prevents_eviction() -> None:
    cache, alloc = make(num_pages=8)
    a = cached(cache, alloc, list(range(8)))
    b = alloc.alloc(2)
    assert cache.insert([*range(4), 9, 9, 9, 9], b) == 4
    alloc.free(b[:1])
    m = cache.match_prefix(list(range(8)))
    cache.lock(m.handle)
    assert cache.evictable_pages == 1
    assert cache.evict(100) == 1
    assert sorted(cache.owned_pages()) == sorted(a)
    assert alloc.num_free == 8 - 2
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.handle)
    with pytest.raises(ValueError):
        cache.unlock(m.handle)
    assert cache.evict(100) == 2
    assert (cache.cached_pages, cache.evictable_pages, alloc.num_free) == (0, 0, 8)
    with pytest.raises(ValueError):
        cache.lock(m.handle)  # evicted handles cannot be locked


def test_lru_order_and_tail_trimming() -> None:
    cache, alloc = make(page_size=1)
    x = cached(cache, alloc, [1, 1])
    y = cached(cache, alloc, [2, 2])
    z = cached(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])
    assert cache.evict(1) == 1  # y is LRU; only its tail page goes
    assert cache.match_prefix([2, 2]).pages == y[:1]  # ...which makes y recent again
    assert cache.evict(2) == 2  # z is now LRU
    assert cache.owned_pages() == x + y[:1]
    assert z[0] in [alloc.alloc(alloc.num_free)][0]


def test_parents_become_evictable_leaves() -> None:
    cache, alloc = make(page_size=1)
    cached(cache, alloc, [1, 2])
    b = alloc.alloc(2)
    assert cache.insert([1, 3], b) == 1
    alloc.free(b[:1])
    assert cache.evict(10) == 3
    assert alloc.num_free == alloc.num_pages and cache.owned_pages() == []


def test_heap_compaction_keeps_eviction_correct() -> None:
    cache, alloc = make(page_size=2, num_pages=32)
    seqs = [[i, i, i, i] for i in range(5)]
    for s in seqs:
        cached(cache, alloc, s)
    for _ in range(300):  # every hit pushes a heap entry
        for s in seqs[1:]:
            cache.match_prefix(s)
    assert len(cache._heap) < 100
    assert cache.evict(2) == 2
    assert cache.match_prefix(seqs[0]).num_tokens == 0
    assert cache.evict(100) == 8


def test_reset_and_determinism() -> None:
    def run() -> list[int]:
        cache, alloc = make(page_size=2, num_pages=40)
        for i in range(6):
            toks = [i % 3, i % 2, i, i, 7, 7]
            m = cache.match_prefix(toks)
            pages = m.pages + alloc.alloc(3 - len(m.pages))
            n = cache.insert(toks, pages)
            alloc.free(pages[len(m.pages) : n // 2])
        cache.evict(5)
        owned = cache.owned_pages()
        cache.reset()
        assert alloc.num_free == 40 and cache.cached_pages == 0
        return owned

    assert run() == run()


def test_long_prompts_are_fast() -> None:
    cache, alloc = make(page_size=1, num_pages=40_000)
    for i in range(4):
        cached(cache, alloc, [i, *range(7999)])
    for _ in range(50):
        assert cache.match_prefix([2, *range(7999)]).num_tokens == 8000


@dataclass
class Req:
    tokens: tuple[int, ...]
    match: PrefixMatch
    own: list[int]


class CacheMachine(RuleBasedStateMachine):
    PS = 1
    NUM_PAGES = 12
    # Few distinct pages so prefixes collide; 0001 vs 0000 mismatch inside a page.
    POOL = [(0,), (1,), (2,)]

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.cache = RadixCache(self.PS, self.alloc)
        self.cache._heap_slack = 2
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.model: dict[tuple[int, ...], int] = {}  # cached prefix (whole pages) -> its last page

    def tokens(self, data: st.DataObject) -> tuple[int, ...]:
        pages = data.draw(st.lists(st.sampled_from(self.POOL), max_size=5))
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.PS - 1))
        return tuple(t for p in pages for t in p) + tuple(tail)

    def tree_map(self) -> dict[tuple[int, ...], int]:
        out: dict[tuple[int, ...], int] = {}
        stack = [((), self.cache._root)]
        while stack:
            prefix, node = stack.pop()
            for j, page in enumerate(node.pages):
                out[prefix + node.key[: (j + 1) * self.PS]] = page
            stack.extend((prefix + node.key, c) for c in node.children.values())
        return out

    def check_match(self, tokens: tuple[int, ...]) -> PrefixMatch:
        n, pages = 0, []
        while n + self.PS <= len(tokens) and tokens[: n + self.PS] in self.model:
            n += self.PS
            pages.append(self.model[tokens[:n]])
        m = self.cache.match_prefix(tokens)
        assert (m.num_tokens, m.pages) == (n, pages)
        return m

    def evict(self, n: int) -> None:
        expected = min(n, self.cache.evictable_pages)
        assert self.cache.evict(n) == expected
        new = self.tree_map()
        assert new.items() <= self.model.items() and len(self.model) - len(new) == expected
        self.model = new

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        tokens = self.tokens(data)
        m = self.check_match(tokens)
        self.cache.lock(m.handle)
        need = -(-len(tokens) // self.PS) - len(m.pages)
        if need > self.alloc.num_free:
            self.evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:
            self.cache.unlock(m.handle)  # rejected: not enough memory even after eviction
            return
        self.reqs[self.next_id] = Req(tokens, m, self.alloc.alloc(need))
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        r = self.reqs.pop(data.draw(st.sampled_from(list(self.reqs))))
        held, full = r.match.pages + r.own, len(r.tokens) // self.PS
        if insert:
            n = self.cache.insert(r.tokens[: full * self.PS], held[:full]) // self.PS
            assert n >= len(r.match.pages)
            for j in range(len(r.match.pages), full):
                prefix = r.tokens[: (j + 1) * self.PS]
                assert (prefix in self.model) == (j < n)
                self.model.setdefault(prefix, held[j])
            assert self.tree_map() == self.model
            self.alloc.free(held[len(r.match.pages) : n] + held[full:])  # duplicates + partial tail
        else:
            self.alloc.free(r.own)  # aborted
        self.cache.unlock(r.match.handle)

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        self.check_match(self.tokens(data))  # may split nodes; the mapping must not change

    @rule(n=st.integers(0, 6))
    def evict_rule(self, n: int) -> None:
        self.evict(n)

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.model = {}
        assert self.alloc.num_free == self.NUM_PAGES

    @invariant()
    def pages_are_conserved_and_locks_consistent(self) -> None:
        owned = self.cache.owned_pages()
        held = [p for r in self.reqs.values() for p in r.own]
        free = list(self.alloc._free)
        everything = owned + held + free
        assert sorted(everything) == list(range(self.NUM_PAGES))  # disjoint and complete
        assert self.tree_map() == self.model
        locks: dict[int, int] = {}
        for r in self.reqs.values():
            node, path = r.match.handle, []
            assert not node.detached
            while node is not self.cache._root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                path = node.pages + path
                node = node.parent
            assert path == r.match.pages
        evictable, num_nodes, stack = 0, 0, [self.cache._root]
        while stack:
            node = stack.pop()
            for key, c in node.children.items():
                assert c.parent is node and c.key[: self.PS] == key and not c.detached
                assert len(c.key) == len(c.pages) * self.PS > 0
                assert c.lock_ref == locks.get(id(c), 0)
                evictable += len(c.pages) if c.lock_ref == 0 else 0
                num_nodes += 1
                stack.append(c)
        assert self.cache.cached_pages == len(owned)
        assert self.cache.evictable_pages == evictable
        assert self.cache._num_nodes == num_nodes


class CacheMachinePage4(CacheMachine):
    PS = 4
    NUM_PAGES = 16
    POOL = [(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1)]


TestCachePage1 = CacheMachine.TestCase
TestCachePage4 = CacheMachinePage4.TestCase
for _case in (TestCachePage1, TestCachePage4):
    _case.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
del _case
