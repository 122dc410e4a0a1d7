"""Prompt log-probs (`SamplingParams(prompt_logprobs=n)`): equal to HF's log-softmax on the same weights,
across chunked prefill and with the prefix cache (skipped for such requests), computed for the rows that
ask only, and leaving every other row, and every batch without such rows, as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.batch import ForwardBatch

PROMPTS = [[5, 9, 31, 7, 2, 88, 41, 3, 17, 64, 12, 5, 9, 31, 90, 23, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_dir("llama"))


def _hf_prompt_logprobs(model_dir: Path, prompt: list[int], top: int) -> tuple[torch.Tensor, torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    logprobs = logits.log_softmax(dim=-1)[:-1]  # position p scores token p + 1
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    return chosen, logprobs.topk(top, dim=-1).values


class _Spy:
    """Records, per forward, whether it listed prompt positions and how many rows reached the LM head."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.runtime.engine
        self.head_rows: list[int] = []
        self.batches: list[ForwardBatch] = []
        compute, step = engine.model.compute_logits, engine.step_logits

        def compute_logits(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            self.head_rows.append(int(hidden.shape[0]))
            return compute(hidden, out)

        def step_logits(batch: ForwardBatch) -> Any:
            self.batches.append(batch)
            return step(batch)

        engine.model.compute_logits = compute_logits  # type: ignore[method-assign]
        engine.step_logits = step_logits  # type: ignore[method-assign]


@pytest.mark.parametrize("chunk_size", [4, 64])  # 4: the first prompt's positions span five chunks
def test_prompt_logprobs_equal_hf_log_softmax(model_dir: Path, chunk_size: int) -> None:
    llm = LLM(str(model_dir), device="cpu", page_size=4, chunk_size=chunk_size)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for _ in range(2):  # the second time, the prompt's pages are in the prefix cache
        (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
        assert out.num_cached_tokens == 0  # skipped for prompt log-probs: a cached prefix has no logits
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(PROMPTS[0]) == len(out.prompt_top_logprobs)
        chosen, top = _hf_prompt_logprobs(model_dir, PROMPTS[0], 3)
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), chosen, atol=1e-4, rtol=1e-4)
        ours_top = torch.tensor([[lp for _, lp in entry] for entry in out.prompt_top_logprobs[1:]])
        torch.testing.assert_close(ours_top, top, atol=1e-4, rtol=1e-4)
    plain = SamplingParams(max_tokens=2, temperature=0)
    (cached,) = llm.generate([PROMPTS[0]], plain, use_tqdm=False)
    assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None  # others still use the cache
    assert cached.token_ids == out.token_ids
    zero = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    (only,) = llm.generate([PROMPTS[1]], zero, use_tqdm=False)
    assert only.prompt_logprobs is not None and len(only.prompt_logprobs) == len(PROMPTS[1])
    assert only.prompt_top_logprobs is None


def test_only_the_asking_rows_pay_and_the_others_are_unaffected(model_dir: Path) -> None:
    prompts = [PROMPTS[0], PROMPTS[1], [40, 41, 42, 43, 44]]
    plain = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    asking = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1)

    baseline_llm = LLM(str(model_dir), device="cpu", page_size=4, prefix_cache=False)
    baseline_spy = _Spy(baseline_llm)
    baseline = baseline_llm.generate(prompts, plain, use_tqdm=False)
    # A batch without asking rows lists no prompt positions: the path it took before prompt log-probs.
    assert all(b.prompt_logprobs is None for b in baseline_spy.batches)
    assert baseline_spy.head_rows == [b.batch_size for b in baseline_spy.batches]

    llm = LLM(str(model_dir), device="cpu", page_size=4, prefix_cache=False)
    spy = _Spy(llm)
    mixed = llm.generate(prompts, [plain, asking, plain], use_tqdm=False)
    for i in (0, 2):  # the other rows: the same tokens and log-probs
        assert mixed[i].token_ids == baseline[i].token_ids
        assert mixed[i].logprobs == pytest.approx(baseline[i].logprobs, abs=1e-5)
        assert mixed[i].prompt_logprobs is None
    assert mixed[1].token_ids == baseline[1].token_ids
    # The LM head saw each batch's rows, plus the asking row's prompt positions (8 of its 9 tokens) once.
    listed = [b for b in spy.batches if b.prompt_logprobs is not None]
    assert len(listed) == 1 and int(listed[0].prompt_logprobs.token_index.shape[0]) == len(PROMPTS[1]) - 1
    assert sum(spy.head_rows) == sum(b.batch_size for b in spy.batches) + len(PROMPTS[1]) - 1


def test_prompt_logprobs_are_validated(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
