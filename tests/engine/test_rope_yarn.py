"""YaRN's frequencies and cos/sin factor (layers/yarn.py, through rotary.py) against HF transformers' own, for
DeepSeek's mscale / mscale_all_dim pair, one mscale alone, an explicit attention_factor and `truncate`
off; and MLA's softmax scale with mscale_all_dim (config.py `LatentAttentionSpec`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

from tandem.engine.config import ModelConfig
from tandem.engine.layers.rotary import cos_sin_scale, inverse_frequencies

BASE: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096}  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3
        {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2-Lite
        {"mscale": 1.0, "mscale_all_dim": 0.707},
        {"attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
        {"truncate": False},
        {},
    ],
)
def test_yarn_matches_hf(extra: dict[str, Any]) -> None:
    params = {**BASE, **extra}
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 8,
           "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "max_position_embeddings": 163840, "rope_parameters": params}  # fmt: skip
    config = ModelConfig.from_dict(raw)
    hf_config = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    inv, factor = inverse_frequencies(config.rope, 64), cos_sin_scale(config.rope)
    assert torch.equal(inv, want_inv)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert config.mla is not None
    assert config.mla.scale == pytest.approx(
        yarn_apply_mscale(hf_config.rope_parameters, 192**-0.5), rel=1e-12
    )
    if extra.get("mscale_all_dim"):
        assert config.mla.scale != pytest.approx(192**-0.5)
