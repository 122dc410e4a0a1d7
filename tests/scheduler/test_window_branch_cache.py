"""Prompts that branch inside an earlier prompt, on models with window layers (windows of 8, pages of 4):
a shared system prompt followed by different user messages longer than a page hits the system prompt,
as does a multi-turn chat, and a small pool makes the tree tombstone window KV while every request still
finishes with the same tokens as without the cache (and as HF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine import engine as engine_module
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.kv_pool import KVGroupSpec, plan_groups
from tandem.scheduler.kv_manager import GroupInfo, KVManager
from tandem.scheduler.messages import AddRequest, SamplingSpec, SchedulerMsg, TokenOutput
from tandem.scheduler.request import Request
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions
from tandem.scheduler.sampling_params import to_spec
from tandem.scheduler.windows.tree import WindowRadixCache

from .test_window_prefix_cache import assert_hf_greedy, random_tokens

WINDOW = 8
PAGE = 4


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "mistral", "gpt_oss"])
def model_dir(request, tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir(request.param, sliding_window=WINDOW)


@pytest.mark.parametrize("system_len", [40, 42])
def test_a_shared_system_prompt_hits_before_long_user_messages(model_dir: Path, system_len: int) -> None:
    """A = S + a, then B = S + b, then C = S + a' (a' shares a's first 6 tokens): a, b and a' are 9 to 13
    tokens, longer than a page, so S ends pages before A's prompt does. B reuses S up to its last whole
    page, C the page-aligned prefix it shares with A; A's and B's answers are the same as without the
    cache and as HF's."""
    vocab = LLM(str(model_dir), device="cpu", prefix_cache=False).vocab_size
    system = random_tokens(system_len, 7, vocab)
    a, b = random_tokens(13, 8, vocab), random_tokens(9, 9, vocab)
    prompts = [system + a, system + b, system + a[:6] + random_tokens(10, 11, vocab)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for prefix_cache in (True, False):
        llm = LLM(str(model_dir), device="cpu", page_size=PAGE, chunk_size=16, prefix_cache=prefix_cache)
        runs.append([llm.generate([p], sp, use_tqdm=False)[0] for p in prompts])
        stats = llm.stats()
        assert stats["kv_pages_used"] == 0 and stats["kv_pages_pending"] == 0
    warm, cold = runs
    aligned = system_len // PAGE * PAGE
    assert [o.num_cached_tokens for o in warm] == [0, aligned, (system_len + 6) // PAGE * PAGE]
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert_hf_greedy(model_dir, prompts, [o.token_ids for o in warm])


def test_multi_turn_chats_hit_their_history_and_the_shared_system_prompt(model_dir: Path) -> None:
    """Two conversations under one 36-token system prompt, three turns each (turn n+1 = turn n's prompt +
    its answer + a new 10-token user message): every later turn reuses its whole history, and the second
    conversation's first turn the system prompt."""
    llm = LLM(str(model_dir), device="cpu", page_size=PAGE, chunk_size=16)
    cold = LLM(str(model_dir), device="cpu", page_size=PAGE, prefix_cache=False)
    system = random_tokens(36, 12, llm.vocab_size)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts, outputs = [], []
    for chat in range(2):
        history = system + random_tokens(10, 20 + chat, llm.vocab_size)
        previous: list[int] = []
        for turn in range(3):
            out = llm.generate([history], sp, use_tqdm=False)[0]
            assert out.token_ids == cold.generate([history], sp, use_tqdm=False)[0].token_ids
            if turn > 0:  # the previous turn's prompt and answer but its last sampled token
                expected = (len(previous) + len(outputs[-1]) - 1) // PAGE * PAGE
            else:
                expected = 36 if chat else 0
            assert out.num_cached_tokens == expected
            prompts.append(history)
            outputs.append(out.token_ids)
            previous = history
            history = history + out.token_ids + random_tokens(10, 30 + 3 * chat + turn, llm.vocab_size)
    assert llm.stats()["kv_pages_used"] == 0
    assert_hf_greedy(model_dir, prompts, outputs)


WINDOW_POOL = 48  # pages of 2 tokens in the window group; the full group gets 160


def _pressure_run(model_dir: Path, prefix_cache: bool) -> tuple[list[list[int]], dict]:  # type: ignore[type-arg]
    """Three waves of 8 requests over two 28-token system prompts, each with its own user message of 6 to
    13 tokens, under overlap with the in-flight page guard on; the window pool holds 48 pages of 2
    tokens: about two requests' worth of window pages (one holding its whole prompt)."""
    llm = LLM(
        str(model_dir),
        device="cpu",
        page_size=2,
        num_pages=160,
        chunk_size=8,
        max_running=4,
        overlap=True,
        guard_inflight_pages=True,
        prefix_cache=prefix_cache,
    )
    systems = [random_tokens(28, 40 + i, llm.vocab_size) for i in range(2)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for wave in range(3):
        prompts = [systems[i % 2] + random_tokens(6 + i, 50 + 8 * wave + i, llm.vocab_size) for i in range(8)]
        tokens += [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    return tokens, llm.stats()


def test_a_small_window_pool_tombstones_window_kv_and_every_request_finishes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree holds the system prompts' window KV along their whole length, so the small window pool
    runs short and the tree gives window pages back (tombstones); every request finishes with the cold
    run's tokens, the system prompts still hit, and no page is left held or pending."""
    tombstoned = []
    evict = WindowRadixCache.evict

    def counting_evict(self: WindowRadixCache, group: int, num_pages: int) -> int:
        n = evict(self, group, num_pages)
        if group in self._windowed:
            tombstoned.append(n)
        return n

    def small_window_pool(config: ModelConfig, num_pages: int) -> list[KVGroupSpec]:
        return plan_groups(config, num_pages, window_pages=WINDOW_POOL)

    monkeypatch.setattr(WindowRadixCache, "evict", counting_evict)
    monkeypatch.setattr(engine_module, "plan_groups", small_window_pool)
    warm, stats = _pressure_run(model_dir, prefix_cache=True)
    assert stats["kv_pages_total_per_group"][-1] == WINDOW_POOL
    assert sum(tombstoned) > 0
    cold, _ = _pressure_run(model_dir, prefix_cache=False)
    assert warm == cold
    assert stats["prefix_cache_hit_tokens"] >= 16 * 28  # waves 2 and 3 reuse their system prompt
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_pending"] == 0


def test_a_request_holds_its_prompt_only_where_the_pool_has_room() -> None:
    """Admission holds the prompt's window pages for the tree when the window pool has room for them,
    and falls back to keeping only the prompt's last window when it has not: a request that fits
    without holding is never refused for it."""
    groups = [GroupInfo(0, None, 64), GroupInfo(1, WINDOW, 14)]
    kv = KVManager(groups, PAGE, prefix_cache=True, chunk_size=16)
    assert kv.budget(1, 70, 60, hold=True) == 17 > 14 == kv.budget(1, 70, 60)
    spec = SamplingSpec(max_tokens=10)
    long = Request(1, list(range(60)), spec, seed=0)
    assert kv.admit(long, 70) and not long.window_hold
    kv2 = KVManager(groups, PAGE, prefix_cache=True, chunk_size=16)
    short = Request(2, list(range(20)), spec, seed=0)
    assert kv2.admit(short, 30) and short.window_hold


def test_the_prompt_is_the_trees_while_its_request_still_decodes() -> None:
    """KV manager level, the scheduler's calls by hand: A's prompt (S + a, 53 tokens) prefills in chunks of
    16 holding its window pages, its first decode row queues it, and once the last prefill batch is
    processed the tree has it: B = S + b, admitted while A decodes, reuses S's 40 tokens. The tree's
    window pages of A's prompt below its last window are evictable, and A's reservation got them back."""
    groups = [GroupInfo(0, None, 64), GroupInfo(1, WINDOW, 64)]
    kv = KVManager(groups, PAGE, prefix_cache=True, chunk_size=16)
    spec = SamplingSpec(max_tokens=10)
    system = list(range(3, 43))
    a = Request(1, system + list(range(100, 113)), spec, seed=0)
    assert kv.admit(a, 63) and a.window_hold
    reserved = list(a.reserved)
    for batch, start in enumerate(range(0, 53, 16)):
        kv.evict_window(a, start, batch - 1)
        kv.grow(a, min(start + 16, 53))
        a.kv_len = min(start + 16, 53)
    assert a.evicted[1] == 10 and kv.stats()["kv_pages_pending"] == 0  # kv_start moved on, pages held
    kv.evict_window(a, 53, 3)  # the first decode row, in batch 4
    kv.grow(a, 54)
    a.kv_len = 54
    kv.flush(2)
    assert a.window_hold and kv.window_cache is not None and kv.window_cache.cached_pages(1) == 0
    kv.flush(3)  # the prompt's last prefill batch is done
    assert not a.window_hold and a.cached_prefix == 52
    # 13 whole pages in both groups; window pages from (52 - 8 + 1) // 4 = 11 on are A's lock's.
    assert [kv.window_cache.cached_pages(g) for g in (0, 1)] == [13, 13]
    assert [kv.window_cache.evictable_pages(g) for g in (0, 1)] == [0, 11]
    assert a.reserved[1] == reserved[1] - 14 + 11  # 14 pages allocated, 11 back
    assert all(kv.available(g) >= 0 for g in (0, 1))
    b = Request(2, system + list(range(200, 209)), spec, seed=0)
    assert kv.admit(b, 59) and b.cached_prefix == b.num_cached_tokens == 40
    assert kv.window_cache.evictable_pages(1) == 9  # B's lock pins window pages 8 and 9 too
    assert kv.window_cache.evict(1, 100) == 9  # pressure: all but the locked windows are tombstoned
    assert kv.window_cache.match_prefix([*system, 1], count=False).num_tokens == 40


def test_a_prompt_hits_while_its_request_still_decodes(model_dir: Path) -> None:
    """B = S + b arrives while A = S + a is still decoding: A's prompt went into the tree once its
    prefill was processed, so B reuses S up to its last whole page then, and both answers are HF's."""
    outputs: list[TokenOutput] = []
    runtime = RankRuntime(model_dir, RuntimeOptions.of(device="cpu", page_size=PAGE, chunk_size=16),
                          TPGroup(), outputs.extend)  # fmt: skip
    vocab = runtime.limits().vocab_size
    system = random_tokens(40, 7, vocab)
    prompts = [system + random_tokens(13, 8, vocab), system + random_tokens(9, 9, vocab)]
    spec = to_spec(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    inbox: list[SchedulerMsg] = [AddRequest(0, prompts[0], spec)]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    cached: dict[int, int] = {}
    finished: set[int] = set()

    def step() -> None:
        runtime.step(lambda blocking: [inbox.pop() for _ in range(len(inbox))])
        for out in outputs:
            if out.token_id is not None:
                tokens[out.rid].append(out.token_id)
            if out.cached_tokens is not None:
                cached[out.rid] = out.cached_tokens
            if out.finish_reason is not None:
                finished.add(out.rid)
        outputs.clear()

    while len(tokens[0]) < 6:
        step()
    inbox.append(AddRequest(1, prompts[1], spec))
    while 1 not in cached:
        step()
    assert 0 not in finished  # A was still decoding when B was admitted
    while len(finished) < 2:
        step()
    assert cached == {0: 0, 1: 40}
    assert_hf_greedy(model_dir, prompts, [tokens[0], tokens[1]])


@pytest.mark.parametrize(
    ("family", "window", "page"), [("gemma2", 6, 4), ("mistral", 5, 2), ("gpt_oss", 3, 4)]
)
def test_windows_that_are_not_a_multiple_of_the_page_size(
    tiny_model_dir, family: str, window: int, page: int
) -> None:  # type: ignore[no-untyped-def]
    """A 23-token system prompt with three user messages, then each conversation's next turn, under
    overlap with the in-flight page guard on: windows of 6, 5 and 3 over pages of 4, 2 and 4 (a window
    that ends inside a page, and one shorter than a page), chunks of 5. The same tokens as without the
    cache and as HF, with real hits."""
    model_dir: Path = tiny_model_dir(family, sliding_window=window)
    sp = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    runs = []
    for prefix_cache in (True, False):
        llm = LLM(str(model_dir), device="cpu", page_size=page, chunk_size=5, prefix_cache=prefix_cache,
                  guard_inflight_pages=True)  # fmt: skip
        system = random_tokens(23, 3, llm.vocab_size)
        prompts = [system + random_tokens(3 + i, 10 + i, llm.vocab_size) for i in range(3)]
        first = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        turns = [
            p + o.token_ids + random_tokens(2, 30 + i, llm.vocab_size)
            for i, (p, o) in enumerate(zip(prompts, first))
        ]
        outs = first + llm.generate(turns, sp, use_tqdm=False)
        runs.append((prompts + turns, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]))
        assert llm.stats()["kv_pages_used"] == 0
    (prompts, warm, cached), (_, cold, cold_cached) = runs
    assert cached[0] == 0 and all(c >= 20 for c in cached[1:]) and cold_cached == [0] * 6
    assert warm == cold
    assert_hf_greedy(model_dir, prompts, warm)
