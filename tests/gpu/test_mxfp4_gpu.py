"""Resident MXFP4 experts on the GPU: the MoE kernels' MXFP4 option (W4A16) against dequantize-then-
matmul at gpt-oss-20b's and gpt-oss-120b's layer shapes (32 or 128 experts, top 4, hidden and
intermediate 2880), the one- and two-token GEMVs and the grouped GEMMs, each captured in a CUDA graph and
replayed on fresh inputs; and gpt-oss-120b's whole shape (36 layers) loading with `load_format="dummy"`
on one GPU, its experts packed, its weight bytes reported and room left for the KV cache; and
benchmarks/kernels/moe_mxfp4.py's GPU run."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.mxfp4 import dequantize

from .conftest import replay_captured

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
H = INTER = 2880  # gpt-oss's hidden and intermediate sizes


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def packed(experts: int, rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes with scales near N(0, 1 / cols): [E, rows, cols / 2] and [E, rows, cols / 32]."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, device=DEVICE, dtype=torch.uint8)
    scales = torch.randint(
        118, 122, (experts, rows, cols // 32), generator=g, device=DEVICE, dtype=torch.uint8
    )
    return blocks, scales


@pytest.mark.parametrize(
    ("experts", "tokens", "rank", "size", "ep"),
    [(32, 1, 0, 1, False), (32, 2, 1, 2, False), (32, 256, 0, 2, False), (32, 256, 1, 2, True),
     (128, 1, 0, 1, False), (128, 2, 0, 1, False), (128, 64, 0, 1, False), (128, 512, 0, 1, False)],
)  # fmt: skip
def test_mxfp4_kernels_match_dequantize_then_matmul_in_a_cuda_graph(
    experts: int, tokens: int, rank: int, size: int, ep: bool
) -> None:
    from tandem.engine.moe.fused import FusedMoE

    g = torch.Generator(device=DEVICE).manual_seed(tokens + rank)
    spec = MoESpec(experts, 4, INTER, False, (True,), scoring="topk_softmax", router_bias=True,
                   expert_bias=True, activation="swiglu_clamped", swiglu_limit=7.0,
                   gpt_oss_layout=True)  # fmt: skip
    shard = ExpertShard.of(spec, rank, size, expert_parallel=ep)
    local, inter = shard.num_local, shard.inter_size
    w13, s13 = packed(local, 2 * inter, H, g)
    w2, s2 = packed(local, H, inter, g)
    b13 = torch.randn(local, 2 * inter, generator=g, device=DEVICE).bfloat16()
    b2 = torch.randn(local, H, generator=g, device=DEVICE).bfloat16()
    x = torch.randn(tokens, H, generator=g, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE).bfloat16()
    fused = FusedMoE(spec, shard, H)

    def run() -> torch.Tensor:
        out: torch.Tensor = fused(x, logits, w13, w2, None, None, False, b13, b2, s13, s2)
        return out

    def refill() -> None:
        x.copy_(torch.randn(tokens, H, generator=g, device=DEVICE).bfloat16())
        logits.copy_(torch.randn(tokens, experts, generator=g, device=DEVICE).bfloat16())

    out = replay_captured(run, refill)
    dense13 = dequantize(w13.view(local, 2 * inter, H // 32, 16), s13).bfloat16()  # exact in bf16
    dense2 = dequantize(w2.view(local, H, inter // 32, 16), s2).bfloat16()
    weights, ids = reference_choice(logits.cpu(), 4, renormalize=False, scoring="topk_softmax")
    want = reference_experts(x, weights, ids, dense13, dense2, expert_start=shard.expert_start, spec=spec,
                             b13=b13, b2=b2 if shard.inter_start == 0 else None)  # fmt: skip
    assert relative_rms(out, want) < 1e-2


GPT_OSS_120B = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "hidden_size": H,
    "intermediate_size": INTER,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_gpt_oss_120b_shape_fits_one_gpu_with_packed_experts(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "gpt-oss-120b-shape"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(GPT_OSS_120B)
    config["rope_parameters"] = {**config["rope_parameters"], "original_max_position_embeddings": 4096}
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), load_format="dummy")
    try:
        engine = llm.runtime.engine
        experts = [m for m in engine.model.modules() if isinstance(m, MoEExperts)]
        assert engine.mxfp4_experts and len(experts) == 36
        assert all(m.w13.dtype == torch.uint8 and m.w13_scales is not None for m in experts)
        # Packed experts: 36 x 128 x (2 x 2880 + 2880) x 2880 x (1/2 + 1/32) bytes = 60.9 GB, with
        # attention, embeddings and the LM head about 65 GB; 16-bit experts would be 234 GB.
        gib = engine.weight_bytes / 2**30
        full = next(group for group in engine.groups if group.window is None)
        kv_tokens = full.num_pages * engine.config.page_size
        print(f"gpt-oss-120b shape: weights {gib:.1f} GiB, KV for {kv_tokens} tokens")
        assert 55 < gib < 66
        assert kv_tokens >= 131072  # room for a full context at least
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].token_ids) == 8
    finally:
        llm.shutdown()


def test_the_mxfp4_kernel_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/kernels/moe_mxfp4.py at gpt-oss-20b's expert shape, one and eight tokens, two layers a
    graph: MXFP4 and the same experts in bf16 each match the float32 reference (the one-token path with
    PDL, as decode graphs launch it), and each is timed against its floor."""
    from tandem.benchmarks.kernels.moe_mxfp4 import main

    record = json.loads(
        main(["--tokens", "1", "8", "--layers", "2", "--out", str(tmp_path / "m.json")]).read_text()
    )
    rows = record["rows"]
    assert [(r["tokens"], r["format"], r["pdl"]) for r in rows] == [
        (1, "mxfp4", torch.cuda.get_device_capability() >= (9, 0)),
        (1, "dense", torch.cuda.get_device_capability() >= (9, 0)),
        (8, "mxfp4", False),
        (8, "dense", False),
    ]
    assert all(r["rel_rms"] < 1e-2 and r["us"] > 0 and r["floor_us"] > 0 for r in rows), rows
