"""The MoE benchmark's arithmetic for the Qwen3-30B-A3B shape, worked by hand: the bytes a batch-1 decode
step must read, and the expert GEMMs' FLOPs and unavoidable bytes at batch 256."""

from __future__ import annotations

import torch

from tandem.benchmarks.moe import QWEN3_30B_A3B, decode_b1_bytes, expert_gemm_cost
from tandem.engine.config import ModelConfig


def config() -> ModelConfig:
    raw = {
        **QWEN3_30B_A3B,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "rms_norm_eps": 1e-6,
    }
    return ModelConfig.from_dict(raw)


def test_decode_b1_bytes() -> None:
    parts = decode_b1_bytes(config(), context=512)
    # q/k/v: 2048 x (32 + 2 * 4) x 128; o: 4096 x 2048; two norms of 2048 and the q/k norms of 128.
    per_layer = 2048 * 40 * 128 + 4096 * 2048 + 2 * 2048 + 2 * 128
    assert parts["attention_weights"] == 48 * per_layer * 2
    assert parts["routed_experts"] == 48 * 8 * 3 * 2048 * 768 * 2  # 3.62 GB: 8 of 128 experts a layer
    assert parts["router"] == 48 * 128 * 2048 * 2
    assert parts["lm_head"] == 151936 * 2048 * 2
    assert parts["kv"] == 48 * 2 * 4 * 128 * 512 * 2
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert 6.0e9 < parts["total"] < 6.2e9


def test_expert_gemms_at_batch_256_must_read_every_expert() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(256)])
    cost = expert_gemm_cost(config(), ids)
    assert cost["experts_hit"] == 128 and cost["rows_per_expert"] == 16.0
    assert cost["flops"] == 2 * 2048 * 3 * 2048 * 768  # 19.3 GFLOP
    weights = 128 * 3 * 2048 * 768 * 2  # 1.21 GB
    assert weights < cost["bytes"] < 1.05 * weights
    # At ~4.8 TB/s that is ~250 µs: ~77 TFLOP/s, a tenth of a dense bf16 matmul's rate on an H200.
    assert 70 < cost["flops"] / (cost["bytes"] / 4.8e12) / 1e12 < 80
