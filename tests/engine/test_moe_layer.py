"""The MoE layer's parts on CPU against the plain reference (engine/moe/reference.py): the tie rule of
routing, the torch experts over random routings with ties and with experts that get no token, the
tensor- and expert-parallel shards (their partial sums add up to the whole layer), both checkpoint
layouts, and the config fields that place the experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.engine.layers.source import InMemorySource
from tandem.engine.moe.experts import FUSED_DOWN, FUSED_GATE_UP, MoEExperts
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.routing import select_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec, check_expert_split

E, K, H, INTER = 8, 3, 24, 20


def tied_logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    """Router logits from three levels only, so most rows tie, many of them at the k-th place."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (tokens, experts), generator=g).float()


def test_the_tie_rule_is_decreasing_probability_then_the_lower_index() -> None:
    for seed in range(20):
        logits = tied_logits(33, E, seed)
        for renormalize in (False, True):
            weights, ids = select_experts(logits, K, renormalize=renormalize)
            want_w, want_ids = reference_choice(logits, K, renormalize=renormalize)
            assert torch.equal(ids, want_ids)
            assert torch.allclose(weights, want_w, atol=1e-7)
    # A tie at the k-th place goes to the lower index: [a, a, b, a] takes experts 0 and 1.
    _, ids = select_experts(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]


def test_without_a_tie_at_the_kth_place_the_choice_is_torch_topk_s() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 64, generator=g)
    weights, ids = select_experts(logits, 8, renormalize=False)
    top_w, top_ids = torch.topk(torch.softmax(logits, -1), 8, dim=-1)
    assert torch.equal(ids, top_ids) and torch.equal(weights, top_w)
    # Ties below the k-th place only: the chosen set and its order are still torch.topk's.
    logits = tied_logits(200, 16, 1)
    clear = torch.argsort(torch.rand(200, 16, generator=g), dim=-1)[:, :4]
    logits.scatter_(1, clear, torch.tensor([9.0, 8.0, 7.0, 6.0]).expand(200, 4))
    _, ids = select_experts(logits, 4, renormalize=False)
    assert torch.equal(ids, torch.topk(torch.softmax(logits, -1), 4, dim=-1).indices)
    assert torch.equal(ids, clear)


def random_experts(seed: int, experts: int = E, inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (unsharded) fused weights: w13 [E, 2I, H] and w2 [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(experts, 2 * inter, H, generator=g) / H**0.5, torch.randn(
        experts, H, inter, generator=g
    )


def build(spec: MoESpec, shard: ExpertShard, w13: torch.Tensor, w2: torch.Tensor, layout: str) -> MoEExperts:
    module = MoEExperts(spec, shard, H, dtype=torch.float32, device=torch.device("cpu"))
    if layout == "fused":
        module.load(InMemorySource("gate_up_proj", w13), FUSED_GATE_UP, is_bias=False)
        module.load(InMemorySource("down_proj", w2), FUSED_DOWN, is_bias=False)
        return module
    inter = spec.expert_intermediate_size
    for e in range(spec.num_experts):
        module.load(InMemorySource("gate", w13[e, :inter]), 3 * e, is_bias=False)
        module.load(InMemorySource("up", w13[e, inter:]), 3 * e + 1, is_bias=False)
        module.load(InMemorySource("down", w2[e]), 3 * e + 2, is_bias=False)
    return module


SPEC = MoESpec(
    num_experts=E, top_k=K, expert_intermediate_size=INTER, renormalize=False, sparse_layers=(True,)
)


@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
@pytest.mark.parametrize("ties", [False, True])
def test_torch_experts_equal_the_reference(tokens: int, ties: bool) -> None:
    w13, w2 = random_experts(1)
    experts = build(SPEC, ExpertShard.of(SPEC, 0, 1, expert_parallel=False), w13, w2, "per-expert")
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    logits = tied_logits(tokens, E, tokens) if ties else torch.randn(tokens, E, generator=g)
    weights, ids = reference_choice(logits, K, renormalize=False)
    if tokens <= 2:  # a decode-sized batch: most experts get no token
        assert len(set(ids.flatten().tolist())) < E
    got = experts(x, logits)
    want = reference_experts(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_shards_add_up_to_the_whole_layer(expert_parallel: bool, layout: str) -> None:
    """Each rank's partial output, summed (the all-reduce), is the unsharded layer; under expert
    parallelism each rank holds E / N whole experts, under tensor parallelism a slice of every one."""
    w13, w2 = random_experts(2)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(17, H, generator=g), tied_logits(17, E, 4)
    whole = build(SPEC, ExpertShard.of(SPEC, 0, 1, expert_parallel=False), w13, w2, layout)(x, logits)
    size = 4 if expert_parallel else 2  # I = 20 splits over 2 ranks, E = 8 over 4
    parts = []
    for rank in range(size):
        shard = ExpertShard.of(SPEC, rank, size, expert_parallel=expert_parallel)
        assert shard.num_local == (E // size if expert_parallel else E)
        assert shard.inter_size == (INTER if expert_parallel else INTER // size)
        parts.append(build(SPEC, shard, w13, w2, layout)(x, logits))
    assert torch.allclose(torch.stack(parts).sum(0), whole, rtol=1e-5, atol=1e-5)


def test_both_checkpoint_layouts_load_the_same_weights_and_bad_shapes_are_named() -> None:
    w13, w2 = random_experts(5)
    shard = ExpertShard.of(SPEC, 1, 2, expert_parallel=False)
    fused, per_expert = (build(SPEC, shard, w13, w2, layout) for layout in ("fused", "per-expert"))
    assert torch.equal(fused.w13, per_expert.w13) and torch.equal(fused.w2, per_expert.w2)
    # A fused tensor stored with its inner dimensions the other way round loads as well.
    flipped = MoEExperts(SPEC, shard, H, dtype=torch.float32, device=torch.device("cpu"))
    flipped.load(
        InMemorySource("gate_up_proj", w13.transpose(1, 2).contiguous()), FUSED_GATE_UP, is_bias=False
    )
    assert torch.equal(flipped.w13, fused.w13)
    with pytest.raises(ValueError, match="expert 2's down projection"):
        per_expert.load(InMemorySource("model.x.down", w2[2, :, :5]), 3 * 2 + 2, is_bias=False)
    names = per_expert.checkpoint_entries("m.mlp.experts", available=())
    assert "m.mlp.experts.7.up_proj.weight" in names and len(names) == 3 * E
    assert set(per_expert.checkpoint_entries("m.mlp.experts", {"m.mlp.experts.gate_up_proj"})) == {
        "m.mlp.experts.gate_up_proj",
        "m.mlp.experts.down_proj",
    }


def test_an_expert_split_that_does_not_divide_is_a_clear_error() -> None:
    six = MoESpec(6, 2, 32, True, (True,))
    with pytest.raises(ValueError, match=r"num_experts \(6\) to divide by tp_size \(4\)"):
        check_expert_split(six, 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"intermediate size \(32\) does not divide by tp_size \(3\)"):
        ExpertShard.of(six, 0, 3, expert_parallel=False)
    assert ExpertShard.of(six, 2, 3, expert_parallel=True) == ExpertShard(4, 2, 0, 32)


QWEN2_MOE: dict[str, Any] = {
    "model_type": "qwen2_moe",
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "intermediate_size": 5632,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def test_specs_of_the_three_families() -> None:
    spec = MoESpec.from_raw(QWEN2_MOE, 6)
    assert spec is not None and not spec.renormalize
    assert spec.sparse_layers == (False, True, False, False, False, True)  # every second, but not 3
    assert (spec.expert_intermediate_size, spec.shared_expert_intermediate_size) == (1408, 5632)
    mixtral = {
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    }
    spec = MoESpec.from_raw(mixtral, 2)
    assert spec is not None and spec.renormalize and spec.sparse_layers == (True, True)
    assert spec.expert_intermediate_size == 64 and spec.shared_expert_intermediate_size == 0
    qwen3 = {**QWEN2_MOE, "model_type": "qwen3_moe", "norm_topk_prob": True, "decoder_sparse_step": 1}
    del qwen3["shared_expert_intermediate_size"]
    spec = MoESpec.from_raw(qwen3, 4)
    assert spec is not None and spec.renormalize and spec.sparse_layers == (True, True, True, False)
    assert MoESpec.from_raw({"model_type": "qwen3", "intermediate_size": 64}, 2) is None


def test_gpt_oss_options_torch_experts_match_the_reference_under_tp_and_ep() -> None:
    """Top-k-then-softmax routing, biased experts and the clamped SwiGLU, loaded from the gpt-oss fused
    layout (transposed, gate/up interleaved): the shards' partial sums add up to the reference, the down
    bias counted once per token."""
    from tandem.engine.moe.spec import MoESpec as Spec

    spec = Spec(E, K, INTER, False, (True,), scoring="topk_softmax", router_bias=True, expert_bias=True,
                activation="swiglu_clamped", swiglu_limit=1.5, gpt_oss_layout=True)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    w13, w2 = random_experts(5)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)
    # transformers' layout: gate_up [E, H, 2I] with gate in the even columns, down [E, I, H].
    hf_gate_up = torch.stack((w13[:, :INTER], w13[:, INTER:]), dim=2).reshape(E, 2 * INTER, H).transpose(1, 2)
    hf_gate_up_bias = torch.stack((b13[:, :INTER], b13[:, INTER:]), dim=2).reshape(E, 2 * INTER)
    x = torch.randn(13, H, generator=g) * 2
    logits = torch.randn(13, E, generator=g)
    weights, ids = reference_choice(logits, K, renormalize=False, scoring="topk_softmax")
    got_w, got_ids = select_experts(logits, K, renormalize=False, scoring="topk_softmax")
    assert torch.equal(got_ids, ids) and torch.allclose(got_w, weights)
    want = reference_experts(x, weights, ids, w13, w2, spec=spec, b13=b13, b2=b2)
    plain = reference_experts(x, weights, ids, w13, w2)
    assert not torch.allclose(want, plain, atol=1e-3)
    tensors = {
        FUSED_GATE_UP: (hf_gate_up, hf_gate_up_bias),
        FUSED_DOWN: (w2.transpose(1, 2).contiguous(), b2),
    }
    for ep in (False, True):
        total = torch.zeros(13, H)
        for rank in range(2):
            shard = ExpertShard.of(spec, rank, 2, expert_parallel=ep)
            experts = MoEExperts(spec, shard, H, dtype=torch.float32, device=torch.device("cpu"))
            for shard_id, (weight, bias) in tensors.items():
                experts.load(InMemorySource("w", weight), shard_id, is_bias=False)
                experts.load(InMemorySource("b", bias), shard_id, is_bias=True)
            total += experts(x, logits)
        torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4)
