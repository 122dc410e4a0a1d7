"""What requests take from the window tree and hand to it (`WindowPrefixCache`).

A later prompt can branch from an earlier one anywhere (a shared system prompt, then different user
messages), and a match ending there needs the window KV of the last `window` tokens before the branch.
So a request hands its whole prompt to the tree as soon as the prefill is computed, with window KV
along all of it: while its prefill runs the request **holds** its prompt's window pages (its window
eviction still moves `kv_start` on, so no kernel reads them), and the tree then keeps them until it
needs the room, tombstoning the least recently used first.
"""

from __future__ import annotations

from collections import deque

from tandem.scheduler.request import Request
from tandem.scheduler.windows.nodes import MISSING, first_window_page
from tandem.scheduler.windows.tree import WindowRadixCache

__all__ = ["WindowPrefixCache", "kept_prompt_pages"]


def kept_prompt_pages(keep_window: int | None, page_size: int, prompt_len: int) -> range:
    """Window pages a request keeps through decode so that the tree has window KV at its prompt's end:
    those a query at the page-aligned prompt end reads through `keep_window` (the tree's widest
    window). Empty without a window tree."""
    if keep_window is None:
        return range(0)
    end = prompt_len // page_size
    return range(first_window_page(end, page_size, keep_window), end)


class WindowPrefixCache:
    """The KV manager's side of the window tree: a request's match at admission, its prompt's insertion
    once the prefill is computed, the whole sequence's on release, and which of its window pages its
    window eviction must keep.

    Ownership: a request's pages below `cached_prefix` are the tree's (under the request's lock); above
    it, a window page below `evicted[g]` is the request's only where `keeps` says so.
    """

    def __init__(self, tree: WindowRadixCache, windows: list[int | None], page_size: int) -> None:
        self.tree = tree
        self.windows = windows
        self.page_size = page_size
        self.keep_window = max(w for w in windows if w is not None)
        # Requests whose prompt goes to the tree once the batch id paired with them has been processed.
        self._prompts: deque[tuple[int, Request]] = deque()

    def keeps(self, req: Request, index: int) -> bool:
        """Whether window eviction passes over the request's page `index`: its prompt's last window, and
        while it holds its prompt for the tree, every whole prompt page."""
        end = req.prompt_len // self.page_size
        return index in kept_prompt_pages(self.keep_window, self.page_size, req.prompt_len) or (
            req.window_hold and index < end
        )

    def _held(self, req: Request, group: int, index: int) -> bool:
        """Whether page `index` of `group` is live in the request's table (the tree's, below its hit)."""
        own = index >= req.cached_prefix // self.page_size
        return index >= req.evicted[group] or (own and self.keeps(req, index))

    def match(self, req: Request, key: list[int]) -> None:
        """Take the longest usable cached prefix of `key` for the request, locked."""
        match = self.tree.match_prefix(key, count=False)
        if match.num_tokens == 0:
            return
        self.tree.lock(match.handle)
        req.prefix_handle = match.handle
        req.cached_prefix = req.kv_len = match.num_tokens
        for g, window in enumerate(self.windows):
            # Below the first query's window the tree may hold no window KV: those table entries are
            # never read (kv_start passes them), so any valid page id stands in for them.
            req.pages[g] = [0 if p == MISSING else p for p in match.pages[g]]
            if window is not None:
                req.evicted[g] = max(0, match.num_tokens - window + 1) // self.page_size

    # ---- the prompt, once computed -----------------------------------------------------------
    def prefill_done(self, req: Request, newest_batch: int) -> None:
        """Called at the request's first decode row: its prompt is computed once `newest_batch` (the
        newest launched, so at latest the one that ended the prefill) has been processed."""
        self._prompts.append((newest_batch, req))

    def ready(self, completed_batch: int) -> list[Request]:
        """Requests whose prompt can go to the tree now that batches up to `completed_batch` are done:
        any batch still in flight reads them from their prompt's last window on, which stays locked."""
        out = []
        while self._prompts and self._prompts[0][0] <= completed_batch:
            req = self._prompts.popleft()[1]
            if req.finish_reason is None and not req.released:  # else release inserts it all
                out.append(req)
        return out

    def insert_prompt(self, req: Request, key: list[int]) -> tuple[list[int], list[list[int]]]:
        """Hand the prompt's whole pages (`key`) to the tree and lock them in place of the request's hit.
        Return per group how many of its pages the request gives up (its reservation gets them back),
        and those of them the caller frees now: no batch still in flight reads them (`ready`)."""
        back = [0] * len(self.windows)
        ps = self.page_size
        end, mine = len(key) // ps, req.cached_prefix // ps
        held = [
            [p[i] if self._held(req, g, i) else MISSING for i in range(end)] for g, p in enumerate(req.pages)
        ]
        req.window_hold = False
        if end <= mine or self.tree.covered(key) > mine:
            # Another request cached part of this prompt first: it goes in on release, as before, and
            # the request gives up the pages it held for it below its window.
            gone = [
                [held[g][i] for i in range(mine, end) if held[g][i] != MISSING and not self._held(req, g, i)]
                for g in range(len(held))
            ]
            return [len(pages) for pages in gone], gone
        self.tree.insert(key, held)  # all new past the hit: the tree takes every page, frees none
        match = self.tree.match_prefix(key, count=False)
        if match.num_tokens != end * ps:
            raise AssertionError(f"prompt of {end} pages inserted, {match.num_tokens // ps} match")
        self.tree.lock(match.handle)
        if req.prefix_handle is not None:
            self.tree.unlock(req.prefix_handle)  # type: ignore[arg-type]
        req.prefix_handle, req.cached_prefix = match.handle, end * ps
        lo = first_window_page(end, ps, self.keep_window)  # the lock pins window pages from here
        for g, window in enumerate(self.windows):
            if window is not None:
                # Taken by the tree with no lock on them: it may evict them for anyone.
                back[g] = sum(1 for i in range(mine, lo) if held[g][i] != MISSING)
                req.evicted[g] = max(req.evicted[g], lo)
        return back, [[] for _ in self.windows]

    # ---- release -----------------------------------------------------------------------------
    def insert_finished(self, req: Request, key: list[int]) -> list[list[int]]:
        """Hand every whole computed page (`key`: the sequence's page-aligned part) to the tree, which
        frees its duplicates itself; return the pages the caller must still free."""
        ps = self.page_size
        whole = len(key) // ps
        mine = req.cached_prefix // ps
        pages = [
            [p[i] if self._held(req, g, i) else MISSING for i in range(whole)]
            for g, p in enumerate(req.pages)
        ]
        if whole:
            self.tree.insert(key, pages)
        # Held pages past what the tree took (a request ended inside its prompt) are the caller's.
        return [
            [p[i] for i in range(mine, len(p)) if i >= whole and self._held(req, g, i)]
            for g, p in enumerate(req.pages)
        ]
