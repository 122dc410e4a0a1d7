"""benchmarks/gpt_oss.py's pure parts: the config it writes is gpt-oss-20b's as tandem reads it, and the
batch-1 floor counts the window layers' KV only up to their window and the experts in the layout given."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.benchmarks.gpt_oss import GPT_OSS_20B, decode_b1_bytes, gsm8k_like, write_config
from tandem.engine.config import ModelConfig


def test_the_written_config_is_gpt_oss_20b(tmp_path: Path) -> None:
    c = ModelConfig.from_dir(write_config(tmp_path / "m", GPT_OSS_20B, mxfp4=True))
    assert c.architecture == "GptOssForCausalLM" and c.moe is not None
    assert (c.num_layers, c.hidden_size, c.moe.num_experts, c.moe.top_k) == (24, 2880, 32, 4)
    assert [c.window_of(i) for i in range(4)] == [128, None, 128, None]
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    plain = json.loads((write_config(tmp_path / "p", GPT_OSS_20B, mxfp4=False) / "config.json").read_text())
    assert "quantization_config" not in plain


def test_the_floor_reads_window_kv_up_to_the_window_and_experts_at_their_width(tmp_path: Path) -> None:
    c = ModelConfig.from_dir(write_config(tmp_path / "m", GPT_OSS_20B, mxfp4=False))
    bf16 = decode_b1_bytes(c, 512, expert_elem=2)
    # 12 window layers read their last 128 tokens, 12 full layers all 512; K and V of 8 heads of 64.
    assert bf16["kv"] == (12 * 128 + 12 * 512) * 2 * 8 * 64 * 2
    assert decode_b1_bytes(c, 64, expert_elem=2)["kv"] == 24 * 64 * 2 * 8 * 64 * 2
    mx = decode_b1_bytes(c, 512, expert_elem=0.5 + 1 / 32)
    weights = 24 * 4 * 3 * 2880 * 2880
    assert bf16["routed_experts"] - mx["routed_experts"] == weights * (2 - 0.5 - 1 / 32)


def test_the_swa_workload_is_gsm8k_shaped() -> None:
    prompts, params = gsm8k_like(50, 1000)
    assert len(prompts) == 50 and all(180 <= len(p) <= 220 for p in prompts)
    assert params.max_tokens == 256 and params.ignore_eos
