"""Bad model directories fail with errors that name the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.hub import resolve_model_dir
from tandem.engine.streams import StreamSet


def build(model_dir: Path) -> Engine:
    config = resolve_engine_config(model_dir, device="cpu", num_pages=16)
    return Engine(config, TPGroup(), StreamSet(torch.device("cpu")))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_supported(tiny_model_dir, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir("qwen3"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"FancyNewForCausalLM.*supported:.*Qwen3ForCausalLM.*Gemma3ForCausalLM"
    ):
        build(d)


def test_missing_config_and_weights(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    d = copy_model(tiny_model_dir("qwen3"), tmp_path / "m")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        build(d)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model_dir(str(tmp_path / "nope" / "model"))


def test_missing_tensor_is_named(tiny_model_dir, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir("qwen3"), tmp_path / "m")
    path = d / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        build(d)


def test_wrong_shape_is_named(tiny_model_dir, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    path = d / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.bias"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"k_proj\.bias.*shape"):
        build(d)
