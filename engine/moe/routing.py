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


def select_experts(
    logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E], in the order taken:
    the softmax is computed in float32, as HF does, and with `renormalize` the k weights sum to one."""
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
