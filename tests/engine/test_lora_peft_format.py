"""What a PEFT adapter may say (engine/lora/peft_format.py): everything tandem does not apply is an error
naming the field or tensor, never a silently different model; and the batch tiles the kernels read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.config import ModelConfig
from tandem.engine.lora.batch import TILE, max_tiles, plan_tiles
from tandem.engine.lora.peft_format import AdapterError, pattern_key, read_adapter
from tandem.engine.tiny.adapters import write_random_adapter


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> tuple[Path, ModelConfig]:
    model_dir = tiny_model_dir("llama")
    return model_dir, ModelConfig.from_dir(model_dir)


def adapter(tmp_path: Path, model_dir: Path, **config: Any) -> Path:
    return write_random_adapter(tmp_path / "a", model_dir, rank=4, targets=["q_proj", "down_proj"], **config)


@pytest.mark.parametrize(
    "field,value",
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("bias", "lora_only"),
        ("lora_bias", True),
        ("fan_in_fan_out", True),
        ("layer_replication", [[0, 2]]),
        ("trainable_token_indices", [1, 2]),
        ("alora_invocation_tokens", [5]),
        ("init_lora_weights", "mica"),
        ("peft_type", "IA3"),
        ("target_modules", ["q_proj", "embed_tokens"]),
        ("a_field_of_a_later_peft", {"on": 1}),
    ],
)
def test_what_tandem_does_not_apply_is_refused_by_name(
    model: tuple[Path, ModelConfig], tmp_path: Path, field: str, value: Any
) -> None:
    model_dir, config = model
    path = adapter(tmp_path, model_dir, **{field: value})
    with pytest.raises(AdapterError, match=field):
        read_adapter(path, config, 16)


def test_inert_fields_pass_and_scales_follow_peft(model: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    model_dir, config = model
    path = adapter(
        tmp_path,
        model_dir,
        use_dora=False,
        lora_dropout=0.1,
        init_lora_weights="gaussian",
        loftq_config={},
        use_rslora=True,
        alpha_pattern={"down_proj": 9},
        layers_to_transform=None,
    )
    read = read_adapter(path, config, 16)
    assert read.rank == 4
    scales = {(m.layer, m.proj): m.scale for m in read.modules}
    assert scales[(0, "q_proj")] == pytest.approx(16 / 2) and scales[(1, "down_proj")] == pytest.approx(9 / 2)
    assert pattern_key({"q_proj": 1}, "model.layers.0.self_attn.q_proj") == "q_proj"
    assert pattern_key({"layers.1.self_attn.q_proj": 1}, "model.layers.0.self_attn.q_proj") is None


def test_shapes_ranks_and_files_are_checked(model: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    model_dir, config = model
    path = adapter(tmp_path, model_dir)
    with pytest.raises(AdapterError, match="max_lora_rank=2"):
        read_adapter(path, config, 2)
    other = ModelConfig.from_dir(model_dir)
    object.__setattr__(other, "hidden_size", config.hidden_size * 2)
    with pytest.raises(AdapterError, match="another model"):
        read_adapter(path, other, 16)
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match="lora_embedding_A"):
        read_adapter(path, config, 16)
    tensors.pop("base_model.model.model.embed_tokens.lora_embedding_A")
    tensors.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match="layer 0 q_proj has no lora_B"):
        read_adapter(path, config, 16)
    (path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "layers_to_transform": [3]})
    )
    with pytest.raises(AdapterError, match="layers_to_transform"):
        read_adapter(path, config, 16)
    weights.unlink()
    with pytest.raises(AdapterError, match=r"no adapter_model\.safetensors"):
        read_adapter(path, config, 16)
    with pytest.raises(AdapterError, match="not a directory"):
        read_adapter(tmp_path / "nowhere", config, 16)


def test_tiles_group_tokens_by_slot_within_the_bound() -> None:
    slots = np.array([2, -1, 0, 2, 1], dtype=np.int32)
    lens = np.array([20, 3, 1, 17, 1], dtype=np.int32)
    token_slots, order, tiles = plan_tiles(slots, lens)
    assert token_slots.tolist() == [2] * 20 + [-1] * 3 + [0] + [2] * 17 + [1]
    assert [int(token_slots[t]) for t in order] == sorted(int(s) for s in token_slots if s >= 0)
    covered = [t for slot, start, end, _ in tiles for t in order[start:end] if token_slots[t] == slot]
    assert sorted(covered) == sorted(np.flatnonzero(token_slots >= 0).tolist())
    assert all(0 < end - start <= TILE for _, start, end, _ in tiles)
    assert len(tiles) <= max_tiles(len(token_slots), 3)
    assert len(plan_tiles(np.array([-1, -1], dtype=np.int32), np.array([4, 1], dtype=np.int32))[2]) == 0
