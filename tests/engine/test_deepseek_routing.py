"""DeepSeek's routers as options of the one MoE layer (moe/routing.py `route`) against HF transformers'
own routers on the same logits: V2's softmax with group-limited greedy top-k and the scaling factor,
V3's sigmoid with the correction bias for the choice only, groups by their top-2 sum, renormalized."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from tandem.engine.moe.routing import route
from tandem.engine.moe.spec import MoESpec

EXPERTS, HIDDEN, TOKENS = 16, 32, 64


def _spec(raw: dict[str, object]) -> MoESpec:
    spec = MoESpec.from_raw(raw, num_layers=2)
    assert spec is not None
    return spec


def _hf_and_ours(
    router: torch.nn.Module, spec: MoESpec, bias: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        x = torch.randn(TOKENS, HIDDEN, generator=g)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = route(logits, spec, bias)
    # The same experts per token, each with the same weight (the order within a row is free).
    hf_order, our_order = hf_ids.sort(dim=-1), ids.sort(dim=-1)
    return (
        hf_order.values,
        our_order.values,
        hf_weights.gather(1, hf_order.indices),
        weights.gather(1, our_order.indices),
    )


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_softmax_routing_matches_hf(method: str) -> None:
    raw = {"model_type": "deepseek_v2", "n_routed_experts": EXPERTS, "num_experts_per_tok": 3,
           "moe_intermediate_size": 8, "topk_method": method, "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 1.7, "norm_topk_prob": False}  # fmt: skip
    config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3,
        topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=1.7)  # fmt: skip
    hf_ids, ids, hf_weights, weights = _hf_and_ours(DeepseekV2TopkRouter(config), _spec(raw), None)
    assert torch.equal(hf_ids, ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_v3_sigmoid_routing_with_its_bias_matches_hf(renormalize: bool) -> None:
    raw = {"model_type": "deepseek_v3", "n_routed_experts": EXPERTS, "num_experts_per_tok": 4,
           "moe_intermediate_size": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
           "norm_topk_prob": renormalize}  # fmt: skip
    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=renormalize)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    bias = torch.linspace(-0.3, 0.3, EXPERTS)
    router.e_score_correction_bias.copy_(bias)
    hf_ids, ids, hf_weights, weights = _hf_and_ours(router, _spec(raw), bias)
    assert torch.equal(hf_ids, ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=0)
    # The bias moved the choice: without it, other experts win somewhere.
    assert not torch.equal(_hf_and_ours(router, _spec(raw), None)[1], ids)
