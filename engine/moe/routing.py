"""The router's choice in torch, for every `MoESpec.scoring` (`route`): the experts' scores, the top k,
and their weights.

The tie rule, everywhere (here, the Triton kernels, the tests' reference): experts are taken in order of
decreasing probability, and among equal probabilities the lower expert index first. It is what a stable
descending sort gives. Without ties at the k-th place this is exactly `torch.topk`'s choice, which is what
HF transformers calls; with such a tie, `torch.topk` on CPU takes whichever of the tied experts
`std::nth_element` leaves in front (no index order at all), so no kernel can reproduce it, and tandem
defines its own. Exact ties need equal router logits: rare in float32, less so in bf16 with many experts.
"""

from __future__ import annotations

import torch

from tandem.engine.moe.spec import MoESpec, Scoring

# What DeepSeek adds to the top-k sum before dividing by it, as its reference code and HF do.
_RENORM_EPS = 1e-20


def select_experts(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, scoring: Scoring = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E], in the order taken:
    the softmax is computed in float32, as HF does, and with `renormalize` the k weights sum to one.
    "topk_softmax" (gpt-oss): the top k logits, then a softmax over them, in the logits' dtype as HF
    computes it (the order of the logits is the order of the probabilities, so the tie rule holds).
    The grouped scorings take `route`."""
    if scoring not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"select_experts chooses ungrouped; {scoring!r} routes through route()")
    if scoring == "topk_softmax":
        top, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        return torch.softmax(top[:, :top_k], dim=-1).float(), ids[:, :top_k]
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(
    logits: torch.Tensor, spec: MoESpec, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) by the spec's scoring (spec.py `Scoring`).
    The one entry point of every router; `score_bias` [E]: "sigmoid_grouped"'s correction bias, added
    to the scores for the choice only."""
    if not spec.grouped:
        return select_experts(logits, spec.top_k, renormalize=spec.renormalize, scoring=spec.scoring)
    sigmoid = spec.scoring == "sigmoid_grouped"
    scores = logits.float().sigmoid() if sigmoid else torch.softmax(logits.float(), dim=-1)
    choice = scores + score_bias.float() if sigmoid and score_bias is not None else scores
    if spec.num_groups > 1:
        grouped = choice.view(choice.shape[0], spec.num_groups, -1)
        # A group's score: its best expert (V2), or the sum of its best two (V3).
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.amax(dim=-1)
        _, kept = torch.sort(group_scores, dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, kept[:, : spec.topk_groups], True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    _, order = torch.sort(choice, dim=-1, descending=True, stable=True)
    ids = order[:, : spec.top_k]
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    return weights * spec.routed_scaling_factor, ids
