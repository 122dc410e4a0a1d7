"""Mixtral, Qwen2-MoE and Qwen3-MoE give HF transformers' greedy tokens (CPU, float32) at tp_size=1,
tp_size=2, and tp_size=2 with expert parallelism over gloo; from the hub's per-expert checkpoint layout
and from transformers' fused one; with a prompt long enough for chunked prefill, and with a one-row
decode batch, where most experts get no token."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import LLM, SamplingParams

from .moe_ranks import CHUNK, MAX_NEW, moe_two_ranks

# Qwen2-MoE both ways: the tiny model's top-k unnormalized, a dense layer (mlp_only_layers=[1]) and a
# shared expert; and here renormalized, with MoE on every second layer only (decoder_sparse_step=2).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe-renorm-step2": (
        "qwen2_moe",
        {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    "qwen3_moe": ("qwen3_moe", {}),
}
PROMPT_LENS = [3, 60, 9, 21]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def cases(tiny_model_dir: Callable[..., Path]) -> dict[str, tuple[Path, list[list[int]], list[list[int]]]]:
    """variant -> (model dir, prompts, HF's greedy tokens)."""
    out = {}
    for name, (family, overrides) in VARIANTS.items():
        model_dir = tiny_model_dir(family, **overrides)
        prompts = prompts_for(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        out[name] = (model_dir, prompts, hf_greedy(model_dir, prompts))
    return out


def fused_layout(model_dir: Path, out: Path) -> Path:
    """The same weights as transformers holds them in memory: experts.gate_up_proj / experts.down_proj."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    hf.save_pretrained(out, save_original_format=False)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp1_greedy_matches_hf(variant: str, cases: dict[str, Any], tmp_path: Path) -> None:
    model_dir, prompts, want = cases[variant]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    layouts = {"per-expert": model_dir}
    if variant in ("mixtral", "qwen2_moe", "qwen3_moe"):
        layouts["fused"] = fused_layout(model_dir, tmp_path / "fused")
        from safetensors import safe_open

        with safe_open(str(layouts["fused"] / "model.safetensors"), "pt") as f:
            assert any(name.endswith("mlp.experts.gate_up_proj") for name in f.keys())  # noqa: SIM118
    assert sum(len(w) for w in want) >= 2 * MAX_NEW  # not all of them end at once
    for layout, path in layouts.items():
        llm = LLM(str(path), device="cpu", chunk_size=CHUNK)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == want, layout
        # One row alone: each decode step routes one token to k of the 8 experts, the rest get none.
        alone = llm.generate([prompts[2]], greedy, use_tqdm=False)[0]
        assert alone.token_ids == want[2], layout
        llm.shutdown()


@pytest.fixture(scope="module")
def two_ranks(cases: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    """Every variant at tp_size=2, with and without expert parallelism, in one pair of processes."""
    jobs = {name: (str(model_dir), prompts) for name, (model_dir, prompts, _) in cases.items()}
    results = moe_two_ranks(jobs)
    return results


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_and_expert_parallel_match_hf(
    variant: str, mode: str, cases: dict[str, Any], two_ranks: dict[int, dict[str, Any]]
) -> None:
    model_dir, _, want = cases[variant]
    key = f"{variant}/{mode}"
    assert two_ranks[0][key]["tokens"] == two_ranks[1][key]["tokens"], "the ranks disagree"
    assert two_ranks[0][key]["tokens"] == want
    # Each rank held half of the 8 experts whole (EP), or all 8 with half of each one's rows (TP).
    config = json.loads((model_dir / "config.json").read_text())
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    hidden = config["hidden_size"]
    held = {(4, 2 * inter, hidden)} if mode == "ep" else {(8, inter, hidden)}
    assert set(two_ranks[0][key]["experts_held"]) == held


def test_experts_that_do_not_divide_over_the_ranks_fail_before_any_rank_starts(
    cases: dict[str, Any],
) -> None:
    model_dir = cases["qwen3_moe"][0]  # 8 experts; moe_intermediate_size 32
    with pytest.raises(ValueError, match=r"num_experts \(8\) to divide by tp_size \(3\)"):
        LLM(str(model_dir), device="cpu", tp_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"intermediate size \(32\) does not divide by tp_size \(3\)"):
        LLM(str(model_dir), device="cpu", tp_size=3)
    # A served replica says so too, before it asks Ray for its rank actors.
    from tandem.replicas.llm_replica import LLMReplica

    replica = LLMReplica(str(model_dir), tp_size=3, device="cpu", engine={"enable_expert_parallel": True})
    with pytest.raises(ValueError, match=r"num_experts \(8\) to divide by tp_size \(3\)"):
        replica._start_blocking()
