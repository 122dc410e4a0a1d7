"""KV page accounting for all requests: allocation, reservations, the prefix cache, window eviction
and the deferred-free rule.

**The deferred-free rule.** With overlap, batch N may still be reading a page on the device while
batch N+1 is being scheduled. So a page given up by a request (window eviction) is not returned to
the allocator at once: it is tagged with the id of the newest launched batch and released in result
processing, after that batch's copy-done event has fired (`flush`). A finished or aborted request is
released the same way by the scheduler, only after the last batch that contains it has completed.
With the window tree, a prompt goes to the tree in `flush` too, once the batch newest at its request's
first decode row has completed (windows/prefix.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.scheduler.pages import PageAllocator
from tandem.scheduler.radix_cache import RadixCache
from tandem.scheduler.request import Request
from tandem.scheduler.windows.prefix import WindowPrefixCache, kept_prompt_pages
from tandem.scheduler.windows.tree import WindowRadixCache

__all__ = ["GroupInfo", "KVManager", "admission_error", "cache_key", "kept_prompt_pages", "page_budget"]


@dataclass(frozen=True)
class GroupInfo:
    group_id: int
    window: int | None
    num_pages: int


@dataclass
class _Pending:
    after_batch: int
    group: int
    pages: list[int]
    owner: Request | None


def cache_key(req: Request, tokens: list[int]) -> list[int]:
    """The radix cache's key for a request's tokens. KV computed under a LoRA adapter is that adapter's
    own (its k/v projections differ), so the first token carries the adapter id above the token ids'
    range: each adapter's prefixes then live in a subtree of their own, apart from the base model's."""
    if req.lora is None or not tokens:
        return tokens
    return [tokens[0] + (req.lora.id << 32), *tokens[1:]]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def page_budget(
    window: int | None,
    page_size: int,
    chunk_size: int,
    total_tokens: int,
    prompt_len: int,
    keep_window: int | None = None,
    hold: bool = False,
) -> int:
    """Most pages a request of `total_tokens` can hold at once in a group (pending release included).
    `keep_window`: the prompt-end window a request keeps for the prefix cache (`kept_prompt_pages`);
    `hold`: it also holds its whole prompt's window pages until the prefill is computed
    (windows/prefix.py), and one or two decode steps can be scheduled before that is processed."""
    full = _ceil_div(total_tokens, page_size)
    if window is None:
        return full
    # Live keys span (p0 - window, p0 + ext); the previous step's evicted pages may still be pending,
    # so allow one more step's worth of tokens.
    step = min(chunk_size, prompt_len)
    live = _ceil_div(window - 1 + 2 * step, page_size) + 1
    kept = _ceil_div(keep_window - 1, page_size) + 1 if keep_window is not None else 0
    held = _ceil_div(prompt_len, page_size) + 2 if hold else 0
    return min(full, max(held, live + kept))


def admission_error(
    groups: list[GroupInfo],
    page_size: int,
    chunk_size: int,
    max_seq_len: int,
    prompt_len: int,
    max_tokens: int,
    keep_window: int | None = None,
) -> str | None:
    """Why a request could never run (too long for the context or the KV pool), or None if it can."""
    if prompt_len + max_tokens > max_seq_len:
        return (
            f"prompt of {prompt_len} tokens plus max_tokens={max_tokens} exceeds the "
            f"context length of {max_seq_len} tokens"
        )
    total = prompt_len + max_tokens
    for g in groups:
        need = page_budget(g.window, page_size, chunk_size, total, prompt_len, keep_window)
        if need > g.num_pages:
            return (
                f"prompt of {prompt_len} tokens plus max_tokens={max_tokens} needs {need} KV pages of "
                f"{page_size} tokens at once, but the pool holds {g.num_pages}"
            )
    return None


class KVManager:
    """Owns one page allocator per KV group, plus the radix cache when prefix caching applies.

    Invariant: every page is exactly one of free, cached (owned by the radix tree), held by a live
    request, or pending release. Admission reserves a request's worst case, so a running request
    never finds the pool empty and nothing is ever dropped.
    """

    def __init__(self, groups: list[GroupInfo], page_size: int, *, prefix_cache: bool, chunk_size: int):
        self.groups = groups
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.allocators = [PageAllocator(g.num_pages) for g in groups]
        # A model with window layers caches through the window-aware tree (windows/tree.py), which can
        # drop window KV apart from full KV, and requests use it through windows/prefix.py; one of full
        # attention only, the plain tree.
        self.cache: RadixCache | None = None
        self.window_cache: WindowRadixCache | None = None
        self.windows: WindowPrefixCache | None = None
        if prefix_cache and any(g.window is not None for g in groups):
            windows = [g.window for g in groups]
            self.window_cache = WindowRadixCache(page_size, self.allocators, windows)
            self.windows = WindowPrefixCache(self.window_cache, windows, page_size)
        elif prefix_cache and len(groups) == 1:
            self.cache = RadixCache(page_size, self.allocators[0])
        # Requests keep their prompt-end window for the tree (`kept_prompt_pages`); budgets count it.
        self.keep_window = self.windows.keep_window if self.windows is not None else None
        self.pending: deque[_Pending] = deque()
        self.outstanding = [0] * len(groups)  # reserved but not yet allocated, over all requests
        self.peak_used = [0] * len(groups)  # most pages held by live requests at once, per group

    @property
    def caching(self) -> bool:
        return self.cache is not None or self.window_cache is not None

    def _cached_pages(self, group: int) -> int:
        if self.window_cache is not None:
            return self.window_cache.cached_pages(group)
        return self.cache.cached_pages if self.cache is not None and group == 0 else 0

    # ---- admission -------------------------------------------------------------------------
    def budget(self, group: int, total_tokens: int, prompt_len: int, hold: bool = False) -> int:
        window = self.groups[group].window
        return page_budget(
            window, self.page_size, self.chunk_size, total_tokens, prompt_len, self.keep_window, hold
        )

    def available(self, group: int) -> int:
        if self.window_cache is not None:
            evictable = self.window_cache.evictable_pages(group)
        else:
            evictable = self.cache.evictable_pages if self.cache is not None and group == 0 else 0
        return self.allocators[group].num_free + evictable - self.outstanding[group]

    def never_fits(self, prompt_len: int, total_tokens: int) -> str | None:
        """Why a request of this size could never be admitted, or None if it can be."""
        max_tokens = total_tokens - prompt_len
        return admission_error(
            self.groups, self.page_size, self.chunk_size, 1 << 62, prompt_len, max_tokens, self.keep_window
        )

    def match_prefix(self, req: Request) -> int:
        """Reuse cached pages for the prompt's prefix, keeping at least one token to compute; return
        how many prompt tokens were looked up."""
        if not self.caching:
            return 0
        if req.sampling.prompt_logprobs is not None:
            return 0  # every prompt position needs its logits, and a cached prefix has none (as vLLM)
        usable = (req.prompt_len - 1) // self.page_size * self.page_size
        key = cache_key(req, req.prompt_ids[:usable])
        if self.windows is not None:
            self.windows.match(req, key)
            return usable
        assert self.cache is not None
        match = self.cache.match_prefix(key, count=False)
        if match.num_tokens == 0:
            return usable
        self.cache.lock(match.handle)
        req.prefix_handle = match.handle
        req.cached_prefix = match.num_tokens
        req.kv_len = match.num_tokens
        req.pages[0] = list(match.pages)
        return usable

    def admit(self, req: Request, total_tokens: int) -> bool:
        """Reserve the request's worst case in every group, or return False to keep it queued. With the
        window tree on, a request holds its prompt's window pages for the tree if the pool has room
        for that now, and keeps only its prompt's last window otherwise (windows/prefix.py)."""
        req.pages = [[] for _ in self.groups]
        req.evicted = [0] * len(self.groups)
        queried = self.match_prefix(req)
        for hold in (True, False) if self.windows is not None else (False,):
            own = self._own(req, total_tokens, hold)
            if all(own[g] <= self.available(g) for g in range(len(self.groups))):
                break
        else:
            self._drop_prefix(req)
            return False
        req.window_hold = hold
        req.num_cached_tokens = req.cached_prefix
        # Counted once per request, not on each try while it waits for pages.
        if self.cache is not None:
            self.cache.record_query(queried, req.cached_prefix)
        if self.window_cache is not None:
            self.window_cache.record_query(queried, req.cached_prefix)
        req.reserved = own
        for g, n in enumerate(own):
            self.outstanding[g] += n
        return True

    def _own(self, req: Request, total_tokens: int, hold: bool) -> list[int]:
        """Pages to reserve per group. A hit's pages are the tree's. A window group's budget bounds what
        the request holds at once of its own, cached pages aside; a full group's counts every page."""
        full_pages = _ceil_div(total_tokens, self.page_size)
        return [
            self.budget(g.group_id, total_tokens, req.prompt_len, hold) - len(p)
            if g.window is None
            else min(self.budget(g.group_id, total_tokens, req.prompt_len, hold), full_pages - len(p))
            for g, p in zip(self.groups, req.pages)
        ]

    def _drop_prefix(self, req: Request) -> None:
        self._unlock_prefix(req)
        req.cached_prefix, req.kv_len = 0, 0
        req.pages = []

    def _unlock_prefix(self, req: Request) -> None:
        if req.prefix_handle is not None:
            if self.window_cache is not None:
                self.window_cache.unlock(req.prefix_handle)  # type: ignore[arg-type]
            elif self.cache is not None:
                self.cache.unlock(req.prefix_handle)  # type: ignore[arg-type]
        req.prefix_handle = None

    # ---- growth and window eviction --------------------------------------------------------
    def grow(self, req: Request, new_len: int) -> list[tuple[int, int, list[int]]]:
        """Allocate pages so the request's KV can hold `new_len` tokens; returns what was allocated,
        as (group, logical index of the first new page, new pages), usually nothing."""
        grown = []
        pages_needed = _ceil_div(new_len, self.page_size)
        for g, pages in enumerate(req.pages):
            need = pages_needed - len(pages)
            if need <= 0:
                continue
            if need > req.reserved[g]:
                raise RuntimeError(f"request {req.rid} outgrew its KV reservation in group {g}")
            new = self._alloc(g, need)
            grown.append((g, len(pages), new))
            pages.extend(new)
            req.reserved[g] -= need
            self.outstanding[g] -= need
            self.peak_used[g] = max(self.peak_used[g], self._used(g))
        return grown

    def _alloc(self, group: int, n: int) -> list[int]:
        allocator = self.allocators[group]
        if allocator.num_free < n and self.window_cache is not None:
            self.window_cache.evict(group, n - allocator.num_free)
        elif allocator.num_free < n and self.cache is not None and group == 0:
            self.cache.evict(n - allocator.num_free)
        return allocator.alloc(n)

    def evict_window(self, req: Request, first_query_pos: int, newest_batch: int) -> None:
        """Give up pages whose every token is outside the window of all queries from now on, apart from
        those kept for the tree (`WindowPrefixCache.keeps`: freed or cached later)."""
        windows = self.windows
        if windows is not None and first_query_pos == req.prompt_len:  # the first decode row
            windows.prefill_done(req, newest_batch)
        for g, info in enumerate(self.groups):
            if info.window is None:
                continue
            keep_from = max(0, first_query_pos - info.window + 1)
            upto = min(keep_from // self.page_size, len(req.pages[g]))
            if upto > req.evicted[g]:
                # Pages of a prefix hit are the tree's (it frees them under its own locks): leave them.
                lo = max(req.evicted[g], req.cached_prefix // self.page_size)
                pages = [
                    req.pages[g][i] for i in range(lo, upto) if windows is None or not windows.keeps(req, i)
                ]
                req.evicted[g] = upto
                if pages:
                    self.pending.append(_Pending(newest_batch, g, pages, req))

    def kv_start(self, req: Request, group: int) -> int:
        return req.evicted[group] * self.page_size

    # ---- release -----------------------------------------------------------------------------
    def release(self, req: Request, token_ids: list[int]) -> None:
        """Return a finished request's pages; call only once no in-flight batch can read them."""
        for g in range(len(self.groups)):
            self.outstanding[g] -= req.reserved[g]
            req.reserved[g] = 0
        if self.windows is not None:
            whole = min(req.kv_len, len(token_ids)) // self.page_size
            key = cache_key(req, token_ids[: whole * self.page_size])
            live = self.windows.insert_finished(req, key)
        else:
            live = [pages[req.evicted[g] :] for g, pages in enumerate(req.pages)]
            if self.cache is not None:
                live[0] = self._insert_into_cache(req, token_ids, live[0])
        for g, pages in enumerate(live):
            self.allocators[g].free(pages)
        self._unlock_prefix(req)
        req.pages = [[] for _ in self.groups]
        req.released = True

    def _insert_into_cache(self, req: Request, token_ids: list[int], pages: list[int]) -> list[int]:
        """Hand whole computed pages to the tree; return the pages the caller must still free."""
        assert self.cache is not None
        computed = min(req.kv_len, len(token_ids))
        whole = computed // self.page_size
        if whole == 0:
            return pages if req.cached_prefix == 0 else pages[req.cached_prefix // self.page_size :]
        already = self.cache.insert(cache_key(req, token_ids[: whole * self.page_size]), pages[:whole])
        mine = req.cached_prefix // self.page_size  # pages that came from the tree itself
        already_pages = already // self.page_size
        return pages[mine:already_pages] + pages[whole:]

    def flush(self, completed_batch: int) -> None:
        """Release pending pages whose readers (batches up to `completed_batch`) have all finished."""
        while self.pending and self.pending[0].after_batch <= completed_batch:
            item = self.pending.popleft()
            self.allocators[item.group].free(item.pages)
            owner = item.owner
            if owner is not None and not owner.released:
                # The owner's budget counts pending pages as held; now they are back, so it may
                # allocate that many again.
                owner.reserved[item.group] += len(item.pages)
                self.outstanding[item.group] += len(item.pages)
        if self.windows is not None:
            ps = self.page_size
            for req in self.windows.ready(completed_batch):
                key = cache_key(req, req.prompt_ids[: req.prompt_len // ps * ps])
                back, gone = self.windows.insert_prompt(req, key)
                for g, n in enumerate(back):
                    self.allocators[g].free(gone[g])
                    req.reserved[g] += n  # free or evictable now: the request may allocate them again
                    self.outstanding[g] += n

    # ---- stats -------------------------------------------------------------------------------
    def _used(self, group: int) -> int:
        """Pages held by live requests: neither free, cached nor waiting for a deferred release."""
        cached = self._cached_pages(group)
        pending = sum(len(item.pages) for item in self.pending if item.group == group)
        return self.groups[group].num_pages - self.allocators[group].num_free - pending - cached

    def stats(self) -> dict[str, int | list[int]]:
        cached = sum(self._cached_pages(g) for g in range(len(self.groups)))
        cache = self.window_cache or self.cache
        totals = [g.num_pages for g in self.groups]
        pending = [sum(len(i.pages) for i in self.pending if i.group == g) for g in range(len(totals))]
        used = [self._used(g) for g in range(len(totals))]
        return {
            "kv_pages_total": sum(totals),
            "kv_pages_used": sum(used),
            "kv_pages_cached": cached,
            "kv_pages_pending": sum(pending),
            "kv_pages_total_per_group": totals,
            "kv_pages_used_per_group": used,
            "kv_pages_peak_per_group": list(self.peak_used),
            "kv_group_windows": [g.window or 0 for g in self.groups],
            "prefix_cache_hit_tokens": cache.hit_tokens if cache is not None else 0,
            "prefix_cache_query_tokens": cache.query_tokens if cache is not None else 0,
        }
