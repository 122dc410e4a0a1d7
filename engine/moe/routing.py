"""The router's choice in torch: softmax over the experts, the top k, and their weights.

The tie rule, everywhere (here, the Triton kernels, the tests' reference): experts are taken in order of
decreasing probability, and among equal probabilities the lower expert index first. It is what a stable
descending sort gives. Without ties at the k-th place this is exactly `torch.topk`'s choice, which is what
HF transformers calls; with such a tie, `torch.topk` on CPU takes whichever of the tied experts
`std::nth_element` leaves in front (no index order at all), so no kernel can reproduce it, and tandem
defines its own. Exact ties need equal router logits: rare in float32, less so in bf16 with many experts.
"""

from __future__ import annotations

import torch

from tandem.engine.moe.spec import Scoring


def select_experts(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, scoring: Scoring = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E], in the order taken:
    the softmax is computed in float32, as HF does, and with `renormalize` the k weights sum to one.
    "topk_softmax" (gpt-oss): the top k logits, then a softmax over them, in the logits' dtype as HF
    computes it (the order of the logits is the order of the probabilities, so the tie rule holds)."""
    if scoring == "topk_softmax":
        top, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        return torch.softmax(top[:, :top_k], dim=-1).float(), ids[:, :top_k]
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
