"""Prefix caching for models with window layers (Gemma 2, Gemma 3, Mistral, gpt-oss with its sinks),
windows of 8 tokens: the same greedy tokens with the cache on, off, and as HF; real hits, reported per
request; pages accounted and none reused while an in-flight batch can read it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.scheduler.kv_manager import GroupInfo, KVManager, kept_prompt_pages
from tandem.scheduler.pages import OutOfPages, PageAllocator
from tandem.scheduler.runtime import RuntimeLimits
from tandem.scheduler.windows.tree import WindowRadixCache

WINDOW = 8
PAGE = 4
TURN_TOKENS = 6


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "mistral", "gpt_oss"])
def model_dir(request, tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir(request.param, sliding_window=WINDOW)


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def assert_hf_greedy(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Teacher-forced HF argmax over each whole sequence, no cache: the window mask decides."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        for p, o in zip(prompts, outputs):
            ref = hf(torch.tensor([p + o])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
            assert o == ref


def test_multi_turn_hits_the_history_and_matches_cache_off_and_hf(model_dir: Path) -> None:
    warm = LLM(str(model_dir), device="cpu", page_size=PAGE, chunk_size=16)
    cold = LLM(str(model_dir), device="cpu", page_size=PAGE, prefix_cache=False)
    sp = SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0, ignore_eos=True)
    history = random_tokens(30, 1, warm.vocab_size)
    prompts, outputs = [], []
    for turn in range(4):
        out = warm.generate([history], sp, use_tqdm=False)[0]
        assert out.token_ids == cold.generate([history], sp, use_tqdm=False)[0].token_ids
        if turn == 0:
            assert out.num_cached_tokens == 0
        else:
            # The previous turn's prompt and outputs, all but its last sampled token, in whole pages:
            # far more than the window, so the full-attention KV before the window is reused too.
            assert out.num_cached_tokens == (len(prompts[-1]) + TURN_TOKENS - 1) // PAGE * PAGE > WINDOW
        prompts.append(history)
        outputs.append(out.token_ids)
        history = history + out.token_ids + random_tokens(9, 10 + turn, warm.vocab_size)
    stats = warm.stats()
    assert stats["prefix_cache_hit_tokens"] > 3 * 30
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_cached"] > 0
    assert_hf_greedy(model_dir, prompts, outputs)


def test_shared_prefixes_and_repeats_in_one_batch(model_dir: Path) -> None:
    """Prompts sharing a 40-token prefix (5 windows), extensions of earlier sequences and repeats, all at
    once: hits where a match can end with its window KV, and the same tokens as without the cache."""
    vocab = LLM(str(model_dir), device="cpu", prefix_cache=False).vocab_size
    shared = random_tokens(40, 2, vocab)
    first = [shared + random_tokens(3 + i, 20 + i, vocab) for i in range(3)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for prefix_cache in (True, False):
        llm = LLM(str(model_dir), device="cpu", page_size=PAGE, chunk_size=16, prefix_cache=prefix_cache)
        before = [o.token_ids for o in llm.generate(first, sp, use_tqdm=False)]
        second = [p + o + random_tokens(5, 30 + i, vocab) for i, (p, o) in enumerate(zip(first, before))]
        second += [shared + random_tokens(4, 40, vocab), first[0] + [5]]
        outs = llm.generate(second, sp, use_tqdm=False)
        results.append((before, second, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]))
        assert llm.stats()["kv_pages_used"] == 0
    (warm_first, prompts, warm_second, cached), (cold_first, _, cold_second, cold_cached) = results
    assert warm_first == cold_first and warm_second == cold_second
    assert cold_cached == [0] * 5
    assert all(c > 40 for c in cached[:3])  # the extensions hit their whole history
    assert_hf_greedy(model_dir, first + prompts, warm_first + warm_second)


def test_a_repeated_prompt_hits_after_any_answer(model_dir: Path) -> None:
    """The request keeps the window KV at its prompt's end through decode (architecture.md), so a repeat
    reuses the prompt up to its last whole page after a short or a long answer, and `num_cached_tokens`
    (what usage's cached_tokens reports) says so."""
    llm = LLM(str(model_dir), device="cpu", page_size=PAGE)
    prompt = random_tokens(30, 3, llm.vocab_size)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 28)
    assert again.token_ids == first.token_ids
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == 28 and stats["prefix_cache_query_tokens"] == 56
    longer = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    other = random_tokens(30, 4, llm.vocab_size)
    long_first = llm.generate([other], longer, use_tqdm=False)[0]
    long_again = llm.generate([other], longer, use_tqdm=False)[0]
    assert long_again.num_cached_tokens == 28 and long_again.token_ids == long_first.token_ids
    assert llm.stats()["kv_pages_used"] == 0


def test_a_shared_system_prompt_hits_after_a_long_answer(model_dir: Path) -> None:
    """A 40-token system prompt (5 windows) with different user suffixes, one request after the other,
    each answering 12 tokens first: every later one reuses the system prompt's whole pages. The suffixes
    end inside the page after the system prompt: the kept window is the prompt end's, so a shared prefix
    hits where its page-aligned end is the prompt's (see architecture.md)."""
    vocab = LLM(str(model_dir), device="cpu", prefix_cache=False).vocab_size
    system = random_tokens(40, 5, vocab)
    prompts = [system + random_tokens(1 + i, 80 + i, vocab) for i in range(3)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for prefix_cache in (True, False):
        llm = LLM(str(model_dir), device="cpu", page_size=PAGE, chunk_size=16, prefix_cache=prefix_cache)
        runs.append([llm.generate([p], sp, use_tqdm=False)[0] for p in prompts])
        assert llm.stats()["kv_pages_used"] == 0
    warm, cold = runs
    assert [o.num_cached_tokens for o in warm] == [0, 40, 40]
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert_hf_greedy(model_dir, prompts, [o.token_ids for o in warm])


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_edge_check_and_the_reservation_both_count_the_kept_window(prefix_cache: bool) -> None:
    """Prompt 30, 40 new tokens, window 8, pages of 4, chunks of 16: the live window needs 11 pages, the
    kept prompt-end window 3 more (2 here, budgeted as ceil(7 / 4) + 1) while the tree is on."""
    assert kept_prompt_pages(WINDOW, PAGE, 30) == range(5, 7)
    need = 14 if prefix_cache else 11
    for pool in (need - 1, need):
        groups = [GroupInfo(0, None, 64), GroupInfo(1, WINDOW, pool)]
        kv = KVManager(groups, PAGE, prefix_cache=prefix_cache, chunk_size=16)
        limits = RuntimeLimits(groups, PAGE, 16, 1024, 1000, 4, keep_window=kv.keep_window)
        assert kv.budget(1, 70, 30) == need
        edge, reserve = limits.admission_error(30, 40), kv.never_fits(30, 70)
        assert (edge is None, reserve is None) == (pool == need, pool == need)


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


def _tight_run(model_dir: Path, prefix_cache: bool) -> tuple[list[list[int]], dict]:  # type: ignore[type-arg]
    llm = LLM(
        str(model_dir),
        device="cpu",
        page_size=2,
        num_pages=96,
        chunk_size=16,
        max_running=4,
        overlap=True,
        guard_inflight_pages=True,
        prefix_cache=prefix_cache,
    )
    stems = [random_tokens(24, 50 + i, llm.vocab_size) for i in range(3)]
    prompts = [stems[i % 3] + random_tokens(1 + i, 60 + i, llm.vocab_size) for i in range(6)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for wave in range(4):  # later waves extend earlier sequences, so they hit
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tokens += [o.token_ids for o in outs]
        prompts = [
            p + o.token_ids + random_tokens(3, 70 + wave, llm.vocab_size) for p, o in zip(prompts, outs)
        ]
    return tokens, llm.stats()


def test_a_tight_pool_with_hits_keeps_pages_accounted_and_unread(
    model_dir: Path, lifo_pages: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 requests of up to 70 tokens through 96 pages of 2 tokens under overlap, the guard on and pages
    reused LIFO: the cache evicts, no page an in-flight batch reads is handed out, and
    nothing leaks."""
    freed: dict[int, int] = {}
    evict = WindowRadixCache.evict

    def counting_evict(self: WindowRadixCache, group: int, num_pages: int) -> int:
        n = evict(self, group, num_pages)
        freed[group] = freed.get(group, 0) + n
        return n

    monkeypatch.setattr(WindowRadixCache, "evict", counting_evict)
    warm, stats = _tight_run(model_dir, prefix_cache=True)
    assert sum(freed.values()) > 0  # Mistral's one group is windowed: there, window KV is tombstoned
    cold, _ = _tight_run(model_dir, prefix_cache=False)
    assert warm == cold
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_pending"] == 0  # the rest is free or cached
