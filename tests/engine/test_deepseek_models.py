"""DeepSeek-V2 (V2-Lite's shape: a plain query projection, softmax group-limited routing) and DeepSeek-V3
(a low-rank query, sigmoid routing with its correction bias, YaRN with both mscales) give HF transformers'
greedy tokens (CPU, float32) over a latent KV cache, at tp_size=1, tp_size=2 and tp_size=2 with expert
parallelism over gloo, from the hub's per-expert layout and transformers' fused one, with a prompt long
enough for chunked prefill; a checkpoint with its MTP layer loads; dummy weights serve."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.engine.config import ModelConfig

from .moe_ranks import CHUNK, MAX_NEW, moe_two_ranks
from .test_moe_models import fused_layout, hf_greedy, prompts_for

FAMILIES = ["deepseek_v2", "deepseek_v3"]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def cases(tiny_model_dir: Callable[..., Path]) -> dict[str, tuple[Path, list[list[int]], list[list[int]]]]:
    """family -> (model dir, prompts, HF's greedy tokens)."""
    out = {}
    for family in FAMILIES:
        model_dir = tiny_model_dir(family)
        prompts = prompts_for(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        out[family] = (model_dir, prompts, hf_greedy(model_dir, prompts))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_greedy_matches_hf_over_a_latent_cache(
    family: str, cases: dict[str, Any], tmp_path: Path
) -> None:
    model_dir, prompts, want = cases[family]
    raw = json.loads((model_dir / "config.json").read_text())
    assert sum(len(w) for w in want) >= 2 * MAX_NEW
    fused = fused_layout(model_dir, tmp_path / "f")
    assert any(
        name.endswith("mlp.experts.gate_up_proj") for name in load_file(str(fused / "model.safetensors"))
    )
    for layout, path in {"per-expert": model_dir, "fused": fused}.items():
        llm = LLM(str(path), device="cpu", chunk_size=CHUNK)
        engine = llm.runtime.engine
        # One latent per token and layer, shared by the heads: kv_c then k_pe, and no V.
        latent = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
        assert tuple(engine.pool.k[0].shape[1:]) == (1, latent)
        assert engine.pool.v[0].shape[-1] == 0
        assert engine.kv_bytes_per_token == raw["num_hidden_layers"] * latent * 4
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == want, layout
        # Again with the prompts' prefixes in the radix cache, and one row alone.
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == want, layout
        alone = llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0]
        assert alone.token_ids == want[2], layout
        llm.shutdown()


@pytest.fixture(scope="module")
def two_ranks(cases: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    """Both families at tp_size=2, with and without expert parallelism, in one pair of processes."""
    jobs = {name: (str(model_dir), prompts) for name, (model_dir, prompts, _) in cases.items()}
    results = moe_two_ranks(jobs)
    return results


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_and_expert_parallel_match_hf(
    family: str, mode: str, cases: dict[str, Any], two_ranks: dict[int, dict[str, Any]]
) -> None:
    model_dir, _, want = cases[family]
    key = f"{family}/{mode}"
    assert two_ranks[0][key]["tokens"] == two_ranks[1][key]["tokens"], "the ranks disagree"
    assert two_ranks[0][key]["tokens"] == want
    config = json.loads((model_dir / "config.json").read_text())
    inter, hidden = config["moe_intermediate_size"], config["hidden_size"]
    held = {(4, 2 * inter, hidden)} if mode == "ep" else {(8, inter, hidden)}
    assert set(two_ranks[0][key]["experts_held"]) == held


def test_the_mtp_layer_loads_and_is_not_run(cases: dict[str, Any], tmp_path: Path) -> None:
    """DeepSeek-V3's checkpoints append `num_nextn_predict_layers` layers after the decoder's: their
    tensors are accepted and skipped, and a name that belongs nowhere still fails."""
    model_dir, prompts, want = cases["deepseek_v3"]
    out = tmp_path / "mtp"
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    last = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    below = f"layers.{last - 1}."
    extra = {k.replace(below, f"layers.{last}."): v.clone() for k, v in weights.items() if below in k}
    hidden = weights["model.embed_tokens.weight"].shape[1]
    extra[f"model.layers.{last}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    extra[f"model.layers.{last}.enorm.weight"] = torch.ones(hidden)
    save_file({**weights, **extra}, str(out / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(out), device="cpu", chunk_size=CHUNK)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    llm.shutdown()
    save_file({**weights, "model.stray.weight": torch.zeros(2)}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.stray\.weight"):
        LLM(str(out), device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_serve(family: str, cases: dict[str, Any]) -> None:
    model_dir, prompts, _ = cases[family]
    llm = LLM(str(model_dir), device="cpu", load_format="dummy", chunk_size=CHUNK)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.token_ids) for o in outs] == [4] * len(prompts)
    llm.shutdown()


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("deepseek_v2", "topk_method", "noaux_tc"),
        ("deepseek_v3", "topk_method", "group_limited_greedy"),
        ("deepseek_v2", "scoring_func", "sigmoid"),
        ("deepseek_v3", "scoring_func", "softmax"),
    ],
)
def test_an_unsupported_router_fails_at_load_naming_it(
    family: str, field: str, value: str, cases: dict[str, Any]
) -> None:
    raw = json.loads((cases[family][0] / "config.json").read_text())
    with pytest.raises(ValueError, match=f"unsupported {field} '{value}'"):
        ModelConfig.from_dict({**raw, field: value})
