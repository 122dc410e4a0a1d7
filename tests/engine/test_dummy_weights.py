"""`load_format="dummy"`: a model built from its config.json alone, with random weights drawn on its
device and no checkpoint read; the tokenizer still comes from the directory. The values are seeded per
parameter name, so every TP rank draws the same router and norms."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.dummy_weights import init_dummy_weights
from tandem.engine.models import model_class
from tandem.engine.models.common import CausalLM


def without_weights(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_directory_without_weights_serves_with_dummy(
    family: str, tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = without_weights(tiny_model_dir(family), tmp_path / family)
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors"):
        LLM(str(model_dir), device="cpu")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(model_dir), device="cpu", load_format="dummy")
        runs.append([o.token_ids for o in llm.generate(["Hello there", [5, 6, 7]], greedy, use_tqdm=False)])
        llm.shutdown()
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])  # seeded: the same model twice


def _rank_model(model_dir: Path, rank: int) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    # No collective runs while a model is built and filled, so a stand-in group object will do.
    tp = TPGroup(rank, 2, object())  # type: ignore[arg-type]
    model = model_class(config.architecture)(config, tp, torch.float32, torch.device("cpu"))
    init_dummy_weights(model)
    return model


def test_ranks_draw_the_same_router_and_norms(tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir("qwen2_moe")
    ranks = [dict(_rank_model(model_dir, r).named_parameters()) for r in range(2)]
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(ranks[0][router], ranks[1][router])
    assert torch.equal(
        ranks[0]["model.layers.0.mlp.shared_expert_gate.weight"],
        ranks[1]["model.layers.0.mlp.shared_expert_gate.weight"],
    )
    norm = ranks[0]["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    bias = ranks[0]["model.layers.0.self_attn.qkv_proj.bias"]
    assert torch.equal(bias, torch.zeros_like(bias))
    experts = ranks[0]["model.layers.0.mlp.experts.w13"]
    assert 0.5 < float(experts.std() * experts.shape[-1] ** 0.5) < 2.0  # ~ N(0, 1 / fan_in)
