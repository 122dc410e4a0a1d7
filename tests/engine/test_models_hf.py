"""Each of the six families matches HF transformers on the same weights (CPU, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.streams import StreamSet
from tandem.engine.tiny import default_model_dir

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]
PROMPT_LENS = [3, 13, 60, 7, 33, 21]


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def prefill_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """One prefill through the engine with a hand-built page table; returns last-token logits."""
    config = resolve_engine_config(model_dir, device="cpu", page_size=4, num_pages=64)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    n = len(prompt)
    table = torch.arange(3, 3 + 32, dtype=torch.int32).unsqueeze(0)  # deliberately not from page 0
    pos = torch.arange(n)
    loc = table[0].long()[pos // 4] * 4 + pos % 4
    zero = torch.zeros(1, dtype=torch.int32)
    group = AttentionGroupBatch(table, zero, loc, zero, table)
    lens = torch.tensor([n], dtype=torch.int32)
    batch = ForwardBatch(
        torch.tensor(prompt),
        pos,
        lens,
        lens,
        lens,
        lens,
        (group,) * len(engine.groups),
        SamplingBatch.greedy(1),
        False,
    )
    engine.attention.plan(batch)
    from tandem.engine.models.context import ForwardContext

    with torch.inference_mode():
        hidden = engine.model(batch.input_ids, batch.positions, ForwardContext(engine.attention, engine.pool))
        return engine.model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf(family: str, tiny_model_dir) -> None:
    model_dir = tiny_model_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    prompt = prompts_for(hf.config.vocab_size)[2]  # 60 tokens: past the 32-token windows
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    ours = prefill_logits(model_dir, prompt)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (
        f"max abs diff {(ours - ref).abs().max().item():.3e}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_matches_hf(family: str, tiny_model_dir) -> None:
    model_dir = tiny_model_dir(family)
    llm = LLM(str(model_dir), device="cpu")
    prompts = prompts_for(llm.vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    ref = hf_greedy(model_dir, prompts, 32)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_window_models_generate_far_past_window(family: str, tiny_model_dir) -> None:
    model_dir = tiny_model_dir(family)
    llm = LLM(str(model_dir), device="cpu", page_size=4)
    prompts = prompts_for(llm.vocab_size)[:2]
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)  # 4x the 32-token window
    outs = llm.generate(prompts, sp, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o.token_ids])
            # Teacher-forced HF argmax over the whole sequence, no cache: the window mask decides.
            ref = hf(ids).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
            assert o.token_ids == ref
            assert len(o.token_ids) == 128


def test_demo_model_answers_in_words_and_matches_hf() -> None:
    """The model `tandem serve` serves by default was trained to write words: its greedy chat answer is
    readable text (no byte noise or control characters), and the engine's tokens equal transformers'."""
    model_dir = default_model_dir()
    llm = LLM(str(model_dir), device="cpu")
    tokenizer = llm.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    out = llm.generate([list(prompt)], SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason == "stop"  # it learned to end its answer with <|im_end|>
    assert out.token_ids == hf_greedy(model_dir, [list(prompt)], 48)[0]
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert all(ch.isprintable() or ch == "\n" for ch in text), repr(text)
    words = text.split()
    assert len(words) >= 4, repr(text)
    # Words, not noise: nearly every word is letters with at most some punctuation around it.
    wordlike = [w for w in words if w.strip(".,;:!?'\"()-").isalpha()]
    assert len(wordlike) >= 0.8 * len(words), repr(text)
