"""Prefix reuse, no leaks under a tight pool, bounded window pages, the deferred-free rule."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.scheduler.kv_manager import KVManager
from tandem.scheduler.pages import OutOfPages, PageAllocator

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (s,), generator=g).tolist() for s in sizes]


def test_prefix_reuse_hits_and_keeps_outputs(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("qwen3"))
    cold = LLM(model_dir, device="cpu", prefix_cache=False)
    warm = LLM(model_dir, device="cpu", page_size=4)
    shared = random_prompts(1, (40, 40), cold.vocab_size, 1)[0]
    tails = random_prompts(4, (3, 12), cold.vocab_size, 2)
    prompts = [shared + t for t in tails]
    expected = [o.token_ids for o in cold.generate(prompts, GREEDY, use_tqdm=False)]
    first = warm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].token_ids == expected[0]
    before = warm.stats()["prefix_cache_hit_tokens"]
    second = warm.generate(prompts, GREEDY, use_tqdm=False)
    stats = warm.stats()
    assert stats["prefix_cache_hit_tokens"] - before >= 3 * 40  # the shared 40 tokens, for 3+ prompts
    assert [o.token_ids for o in second] == expected
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_cached"] > 0
    assert cold.stats()["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_200_requests_through_a_small_pool(tiny_model_dir, overlap: bool) -> None:
    model_dir = str(tiny_model_dir("qwen3"))
    # 64 pages x 4 tokens = 256 tokens of KV; the requests need ~200 x 40 in total.
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=64, overlap=overlap, max_running=16)
    prompts = random_prompts(200, (5, 30), llm.vocab_size, 3)
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)
    stats = llm.stats()
    assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_window_pages_stay_bounded(tiny_model_dir, prefix_cache: bool) -> None:
    model_dir = str(tiny_model_dir("gemma3"))
    llm = LLM(model_dir, device="cpu", page_size=4, chunk_size=16, prefix_cache=prefix_cache)
    prompt = random_prompts(1, (20, 20), llm.vocab_size, 4)[0]
    window = 32
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4 * window, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 4 * window
    stats = llm.stats()
    full_group, window_group = stats["kv_group_windows"].index(0), stats["kv_group_windows"].index(window)
    total_pages = -(-(len(prompt) + 4 * window) // 4)
    # With the prefix cache the prompt's whole pages are the tree's once its prefill is done (locked by
    # the request, counted as cached): the request itself holds the rest.
    handed = len(prompt) // 4 if prefix_cache else 0
    assert stats["kv_pages_peak_per_group"][full_group] == total_pages - handed
    # window/page_size + 1 pages, plus one step of slack while the last eviction is in flight; with the
    # prefix cache, plus the prompt's last window (here the whole 20-token prompt), kept for the tree.
    kept = len(prompt) // 4 if prefix_cache else 0
    assert stats["kv_pages_peak_per_group"][window_group] <= window // 4 + 2 + kept
    assert stats["kv_pages_used"] == 0


@pytest.fixture
def lifo_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reuse the most recently freed page first: the allocator policy that exposes early reuse."""

    def alloc(self: PageAllocator, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages but only {len(self._free)} are free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = 0
        return out

    monkeypatch.setattr(PageAllocator, "alloc", alloc)


def _tight_window_run(model_dir: str, overlap: bool, prefix_cache: bool = True) -> list[list[int]]:
    llm = LLM(
        model_dir,
        device="cpu",
        page_size=2,
        num_pages=48,
        chunk_size=16,
        max_running=4,
        overlap=overlap,
        guard_inflight_pages=True,
        prefix_cache=prefix_cache,
    )
    prompts = random_prompts(10, (10, 40), llm.vocab_size, 6)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.stats()["kv_pages_used"] == 0
    return [o.token_ids for o in outs]


def test_deferred_free_rule_holds_under_overlap(tiny_model_dir, lifo_pages: None) -> None:
    model_dir = str(tiny_model_dir("mistral"))
    assert _tight_window_run(model_dir, overlap=True) == _tight_window_run(model_dir, overlap=False)


def test_guard_catches_early_reuse_when_the_rule_is_removed(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, lifo_pages: None
) -> None:
    """Without the deferral, a window page is handed out while the in-flight batch still reads it."""
    original = KVManager.evict_window

    def evict_now(self, req, first_query_pos, newest_batch):  # type: ignore[no-untyped-def]
        original(self, req, first_query_pos, newest_batch)
        self.flush(newest_batch)  # free at once: the bug the rule prevents

    monkeypatch.setattr(KVManager, "evict_window", evict_now)
    with pytest.raises(AssertionError, match="reused while batch"):
        # Without the prefix cache: every window page a request gives up goes through the deferral (with
        # it, the prompt's go to the tree, which keeps its prompt's last window locked).
        _tight_window_run(str(tiny_model_dir("mistral")), overlap=True, prefix_cache=False)
