"""Sampling with drafts keeps the target's distribution: a chi-square test on a 12-token vocabulary,
unseeded requests (the sampler's own generator, a different random path from a seeded one), drafts on
and off."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

VOCAB = 12
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repeats, so the lookup drafts after most first tokens
REQUESTS = 400


def _pooled(observed: list[int], expected: list[float]) -> tuple[list[int], list[float]]:
    """Cells with under 5 expected draws merged into one, as the chi-square approximation needs."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:
            rest_o, rest_e = rest_o + o, rest_e + e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    return obs, exp


@pytest.fixture(scope="module")
def model_and_marginals(tiny_model_dir):  # type: ignore[no-untyped-def]
    """The model, and the exact marginals of its 2nd and 3rd sampled tokens at temperature 1 and
    top_k=6 (HF logits, filtered and renormalised in float64)."""
    model_dir = tiny_model_dir("qwen3", vocab_size=VOCAB, pad_token_id=0, bos_token_id=0, eos_token_id=[11])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()

    def probs(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(seqs).logits[:, -1].double()
        kth = logits.topk(6, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    every = torch.arange(VOCAB)
    p1 = probs(torch.tensor([PROMPT]))[0]
    seq2 = torch.cat([torch.tensor([PROMPT]).expand(VOCAB, -1), every[:, None]], 1)
    p2 = probs(seq2)  # [x1, x2]
    seq3 = torch.cat([seq2.repeat_interleave(VOCAB, 0), every.repeat(VOCAB)[:, None]], 1)
    p3 = probs(seq3).view(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    joint12 = p1[:, None] * p2
    marginal2 = joint12.sum(0)
    marginal3 = (joint12[:, :, None] * p3).sum((0, 1))
    return model_dir, marginal2, marginal3


@pytest.mark.parametrize("drafts", [True, False], ids=["ngram", "plain"])
def test_sampled_tokens_follow_the_target_distribution(model_and_marginals, drafts: bool) -> None:  # type: ignore[no-untyped-def]
    model_dir, marginal2, marginal3 = model_and_marginals
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if drafts else {}
    llm = LLM(str(model_dir), device="cpu", overlap=False, seed=5, max_running=200, **spec)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True)
    outs = llm.generate([PROMPT] * REQUESTS, params, use_tqdm=False)
    for position, marginal in ((1, marginal2), (2, marginal3)):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=VOCAB)
        obs, exp = _pooled(counts.tolist(), (marginal * REQUESTS).tolist())
        assert chisquare(obs, exp).pvalue > 1e-3, (position, obs, exp)
    stats = llm.stats()
    if drafts:
        # Drafts were verified at these positions, and both accepted and rejected.
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    llm.shutdown()
