"""The prefix cache's hit per request: the scheduler reports it on a request's first token, page-rounded
as the radix cache stores it (the last prompt token is always computed, so a repeat of a prompt of L
tokens hits (L - 1) // page_size * page_size of them)."""

from __future__ import annotations

import torch

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PAGE = 4


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def test_cached_tokens_are_the_page_rounded_hit(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", page_size=PAGE)
    prompt = _prompt(41, 1, llm.vocab_size)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # a cold cache
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 40  # all but the last token, in whole pages
    assert again.token_ids == first.token_ids
    # A prompt sharing 22 tokens hits the 5 whole pages of them. The prompt extended by its first output
    # is cached whole (the cache keeps prompt and outputs), but matching stops at (42 - 1) // 4 pages.
    shared = prompt[:22] + _prompt(19, 2, llm.vocab_size)
    longer = prompt + first.token_ids[:1]
    outs = llm.generate([shared], GREEDY, use_tqdm=False) + llm.generate([longer], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [20, 40]
    cold = LLM(str(tiny_model_dir("qwen3")), device="cpu", page_size=PAGE, prefix_cache=False)
    assert [o.num_cached_tokens for o in cold.generate([prompt, prompt], GREEDY, use_tqdm=False)] == [0, 0]
