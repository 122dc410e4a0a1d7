"""Block-scaled FP8 experts (the hub's per-expert `weight` + `weight_scale_inv`, as the Qwen3 `-FP8` and
DeepSeek-V3 releases ship them) load into the one MoE layer: a tiny Qwen3-MoE with FP8 attention and
experts, and a tiny DeepSeek-V3 with FP8 latent attention (kv_b_proj read dequantized, as the absorbed
form reads it), experts and shared expert, give HF transformers' greedy tokens on the dequantized weights
at tp_size 1, 2 and 2 with expert parallelism (CPU, float32); a TP split that would cut a scale block
fails by name. The experts held as FP8 (what CUDA with Triton does) are tested in
test_fp8_experts_resident.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tandem import LLM, SamplingParams
from tandem.engine.models.latent_attention import LatentAttention
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.fp8_export import write_fp8_checkpoint
from tandem.engine.quant.fp8_format import Fp8Checkpoint
from tandem.engine.weights import load_weights

from .moe_ranks import CHUNK, MAX_NEW, moe_two_ranks
from .test_moe_models import hf_greedy, prompts_for

BLOCK = (16, 16)  # the tiny experts' intermediate size 32 splits into whole blocks over two ranks


def fp8_case(src: Path, root: Path) -> dict[str, Any]:
    fp8_dir, ref_dir = root / "fp8", root / "ref"
    write_fp8_checkpoint(src, fp8_dir, ref_dir, layout="block", block=BLOCK)
    prompts = prompts_for(json.loads((src / "config.json").read_text())["vocab_size"])
    return {"dir": fp8_dir, "src": src, "prompts": prompts, "want": hf_greedy(ref_dir, prompts)}


@pytest.fixture(scope="module")
def fp8_deepseek(
    tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return fp8_case(tiny_model_dir("deepseek_v3"), tmp_path_factory.mktemp("fp8-deepseek"))


@pytest.fixture(scope="module")
def fp8_moe(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fp8_case(tiny_model_dir("qwen3_moe"), tmp_path_factory.mktemp("fp8-moe"))


def test_the_checkpoint_holds_fp8_experts(fp8_moe: dict[str, Any]) -> None:
    with safe_open(str(fp8_moe["dir"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        expert = "model.layers.0.mlp.experts.3.down_proj"
        assert f"{expert}.weight_scale_inv" in names
        assert str(f.get_slice(f"{expert}.weight").get_dtype()) == "F8_E4M3"


def test_tp1_matches_hf_on_the_dequantized_weights(fp8_moe: dict[str, Any]) -> None:
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    llm = LLM(str(fp8_moe["dir"]), device="cpu", chunk_size=CHUNK)
    outs = llm.generate(fp8_moe["prompts"], greedy, use_tqdm=False)
    llm.shutdown()
    assert [o.token_ids for o in outs] == fp8_moe["want"]
    # The FP8 rounding changes the model: the equality above is not the source model's by accident.
    plain = LLM(str(fp8_moe["src"]), device="cpu", chunk_size=CHUNK)
    base = plain.generate(fp8_moe["prompts"], greedy, use_tqdm=False)
    plain.shutdown()
    assert [o.token_ids for o in base] != fp8_moe["want"]


def test_deepseek_v3_fp8_matches_hf_with_kv_b_proj_dequantized(fp8_deepseek: dict[str, Any]) -> None:
    with safe_open(str(fp8_deepseek["dir"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for module in ("self_attn.kv_b_proj", "self_attn.q_a_proj", "mlp.experts.3.down_proj",
                       "mlp.shared_experts.up_proj"):  # fmt: skip
            assert f"model.layers.1.{module}.weight_scale_inv" in names, module
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    llm = LLM(str(fp8_deepseek["dir"]), device="cpu", chunk_size=CHUNK)
    try:
        outs = llm.generate(fp8_deepseek["prompts"], greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == fp8_deepseek["want"]
        # kv_b_proj runs no GEMM (the absorbed form reads its weight as W_UK and W_UV), so loading does
        # not hand it to the FP8 GEMMs: on GPU too it stays dequantized, in the compute dtype.
        model = llm.runtime.engine.model
        fp8 = Fp8Checkpoint.from_dir(fp8_deepseek["dir"])
        report = load_weights(model, fp8_deepseek["dir"], None, fp8)
        attention = [m for m in model.modules() if isinstance(m, LatentAttention)]
        assert attention and not any(m.kv_b_proj in report.fp8_modules for m in attention)
        assert any(m.q_b_proj in report.fp8_modules for m in attention)
        assert all(m.kv_b_proj.weight.dtype == torch.float32 for m in attention)
    finally:
        llm.shutdown()
    plain = LLM(str(fp8_deepseek["src"]), device="cpu", chunk_size=CHUNK)
    base = plain.generate(fp8_deepseek["prompts"], greedy, use_tqdm=False)
    plain.shutdown()
    assert [o.token_ids for o in base] != fp8_deepseek["want"]


def test_tp2_and_expert_parallel_match_hf(fp8_moe: dict[str, Any], fp8_deepseek: dict[str, Any]) -> None:
    cases = {"fp8": fp8_moe, "fp8-deepseek": fp8_deepseek}
    jobs = {name: (str(case["dir"]), case["prompts"]) for name, case in cases.items()}
    results = moe_two_ranks(jobs)
    for name, case in cases.items():
        for mode in ("tp", "ep"):
            assert results[0][f"{name}/{mode}"]["tokens"] == case["want"], (name, mode)
            assert results[1][f"{name}/{mode}"]["tokens"] == case["want"], (name, mode)


@pytest.mark.parametrize(
    ("block", "rank", "ep", "fails"),
    [
        ((24, 24), 0, False, True),  # rows [0, 16) end inside the first 24-row block
        ((24, 24), 1, False, True),  # rows [16, 32) start inside it
        ((24, 24), 0, True, False),  # expert parallelism keeps every expert whole
        ((16, 16), 1, False, False),
    ],
)
def test_a_split_that_cuts_a_scale_block_fails_by_name(
    block: tuple[int, int], rank: int, ep: bool, fails: bool, tiny_model_dir: Callable[..., Path]
) -> None:
    config = json.loads((tiny_model_dir("qwen3_moe") / "config.json").read_text())
    spec = MoESpec.from_raw(config, config["num_hidden_layers"])
    assert spec is not None and spec.expert_intermediate_size == 32
    shard = ExpertShard.of(spec, rank, 2, expert_parallel=ep)
    experts = MoEExperts(spec, shard, config["hidden_size"], dtype=torch.float32, device=torch.device("cpu"))
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    for shard_id in (3 + 1, 3 + 2):  # expert 1's up (rows) and down (columns) projections
        if fails:
            with pytest.raises(ValueError, match=r"cut its 24-wide scale blocks.*enable_expert_parallel"):
                experts.check_fp8_split(block, shard_id, name)
        else:
            experts.check_fp8_split(block, shard_id, name)
    with pytest.raises(ValueError, match="per-expert layout"):
        experts.check_fp8_split(block, -1, "model.layers.0.mlp.experts.gate_up_proj")
