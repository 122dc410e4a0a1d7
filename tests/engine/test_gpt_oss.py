"""gpt-oss gives HF transformers' greedy tokens (CPU, float32) on a tiny random model with every bias and
the sinks non-zero: prompts longer than the window (16) and than YaRN's original context (64), prefilled
in chunks, the window layers in their own KV group with eviction on. Also its pieces one by one against
transformers: YaRN's frequencies and attention factor, sink attention, the router and the experts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from tandem import LLM, SamplingParams
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import plan_groups
from tandem.engine.layers.rotary import cos_sin_scale, inverse_frequencies
from tandem.engine.moe.activation import gated
from tandem.engine.moe.routing import select_experts

from .moe_ranks import MAX_NEW
from .test_moe_models import hf_greedy

PROMPT_LENS = [3, 70, 9, 33]
CHUNK = 16  # the 70-token prompt prefills in five chunks
WINDOW = 16


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def case(tiny_model_dir: Callable[..., Path]) -> tuple[Path, list[list[int]], list[list[int]]]:
    model_dir = tiny_model_dir("gpt_oss")
    prompts = prompts_for(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return model_dir, prompts, hf_greedy(model_dir, prompts)


def test_tiny_model_has_every_bias_and_sink_nonzero(case: Any) -> None:
    from safetensors.torch import load_file

    weights = load_file(case[0] / "model.safetensors")
    extras = [n for n in weights if n.endswith(("bias", "sinks"))]
    assert len(extras) == 4 * 8  # q, k, v, o, router, gate/up, down biases and the sinks, per layer
    assert all(bool((weights[n] != 0).all()) for n in extras)
    config = ModelConfig.from_dir(case[0])
    assert config.sliding_window == WINDOW and config.layer_types.count("sliding_attention") == 2
    assert config.rope.rope_type == "yarn" and config.moe is not None and config.moe.scoring == "topk_softmax"
    # Full-attention and window layers in their own page groups: the window group's pages are evicted.
    groups = plan_groups(config, num_pages=64)
    assert [(g.layers, g.window) for g in groups] == [((1, 3), None), ((0, 2), WINDOW)]


def test_tp1_greedy_matches_hf(case: Any) -> None:
    model_dir, prompts, want = case
    assert sum(len(w) for w in want) >= 2 * MAX_NEW
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    llm = LLM(str(model_dir), device="cpu", chunk_size=CHUNK, page_size=4)
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        alone = llm.generate([prompts[1]], greedy, use_tqdm=False)[0]
        assert alone.token_ids == want[1]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("attention_factor", [None, 1.3])
def test_yarn_matches_transformers(truncate: bool, attention_factor: float | None) -> None:
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": truncate,
        "original_max_position_embeddings": 4096,
    }
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    hf_config = GptOssConfig(head_dim=64, rope_parameters=rope, num_hidden_layers=2)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    raw = hf_config.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    ours = ModelConfig.from_dict(raw).rope
    assert torch.equal(inverse_frequencies(ours, 64), want_inv)
    assert cos_sin_scale(ours) == want_factor


def test_sink_attention_matches_transformers_eager() -> None:
    from tandem.engine.attention.sinks import apply_sinks, softmax_with_sinks

    torch.manual_seed(0)
    heads, q_len, kv_len, dim = 4, 5, 9, 8
    q, k, v = (torch.randn(1, heads, n, dim) for n in (q_len, kv_len, kv_len))
    sinks = torch.randn(heads) * 2
    causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    mask = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]
    module = type("M", (), {"num_key_value_groups": 1, "sinks": sinks, "training": False})()
    want, _ = hf_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=0.3)  # [1, Q, H, D]
    scores = torch.matmul(q[0], k[0].transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~causal, float("-inf"))
    got = torch.matmul(softmax_with_sinks(scores, sinks), v[0]).transpose(0, 1)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
    # The epilogue form: plain attention rescaled by sigmoid(lse - sink), lse in base 2 or natural.
    plain = torch.matmul(torch.softmax(scores, dim=-1), v[0]).transpose(0, 1)  # [Q, H, D]
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [Q, H]
    torch.testing.assert_close(
        apply_sinks(plain.clone(), lse, sinks, base2=False), want[0], rtol=1e-5, atol=1e-6
    )
    lse2 = lse / torch.log(torch.tensor(2.0))
    torch.testing.assert_close(
        apply_sinks(plain.clone(), lse2, sinks, base2=True), want[0], rtol=1e-5, atol=1e-6
    )
    assert not torch.allclose(plain, want[0], atol=1e-3)  # the sinks matter here


def test_router_and_experts_match_transformers() -> None:
    hf_config = GptOssConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=6, num_experts_per_tok=3, num_hidden_layers=1
    )
    torch.manual_seed(1)
    x = torch.randn(7, 16) * 3
    router = hf_gpt_oss.GptOssTopKRouter(hf_config)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    logits, want_w, want_ids = router(x)
    weights, ids = select_experts(logits, 3, renormalize=False, scoring="topk_softmax")
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w)
    experts = hf_gpt_oss.GptOssExperts(hf_config)
    gate_up = torch.randn(7, 16) * 5  # large enough that both clamps bite
    spec = ModelConfig.from_dict(hf_config.to_dict() | {"architectures": ["GptOssForCausalLM"]}).moe
    assert spec is not None and spec.activation == "swiglu_clamped"
    assert bool((gate_up.abs() > spec.swiglu_limit).any())
    assert torch.equal(gated(gate_up[:, 0::2], gate_up[:, 1::2], spec), experts._apply_gate(gate_up))


@pytest.fixture(scope="module")
def two_ranks(case: Any) -> dict[int, dict[str, dict[str, Any]]]:
    """tp_size=2, with and without expert parallelism, over gloo (test_moe_models' worker)."""

    from .moe_ranks import moe_two_ranks

    model_dir, prompts, _ = case
    jobs = {"gpt_oss": (str(model_dir), prompts)}
    results = moe_two_ranks(jobs)
    return results


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_tp2_and_expert_parallel_match_hf(mode: str, case: Any, two_ranks: dict[int, Any]) -> None:
    _, _, want = case
    for rank in (0, 1):
        got = two_ranks[rank][f"gpt_oss/{mode}"]
        assert got["tokens"] == want, (rank, mode)
        # [E_local, 2 I_local, H]: TP halves every expert's intermediate rows, EP holds half the experts.
        expected = (8, 128, 64) if mode == "tp" else (4, 256, 64)
        assert set(got["experts_held"]) == {expected}
