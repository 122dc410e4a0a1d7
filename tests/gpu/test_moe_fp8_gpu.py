"""FP8 block-scaled experts held in FP8 on the GPU: the MoE kernels' FP8 option (W8A16, 128 x 128 block
scales applied in the kernels) against dequantize-then-matmul at Qwen3-30B-A3B's layer shape (128
experts, top 8, hidden 2048, expert intermediate 768), the one- and two-token GEMVs and the grouped
GEMMs, a TP shard and an EP one, each captured in a CUDA graph and replayed on fresh inputs; a
block-scaled FP8 Qwen3-MoE checkpoint held so under decode and piecewise graphs giving the greedy tokens
of its dequantized weights run in bf16 (up to near-ties); and Qwen3-30B-A3B's whole shape loading with
`load_format="dummy"` with its experts in FP8 and its weight bytes the FP8 size; a block-scaled FP8
DeepSeek-V3 (real and dummy) serving with kv_b_proj dequantized for the absorbed latent attention."""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.fp8_format import FP8, quantize_blocks

from .conftest import greedy_disagreements, replay_captured

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="Triton converts FP8 from compute capability 8.9 on",
    ),
]

DEVICE = torch.device("cuda")
E, K, H, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B's MoE layer
BLOCK = (128, 128)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def fp8_experts(
    experts: int, rows: int, cols: int, g: torch.Generator, *, stacked: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts` weights of `stacked` [rows, cols] projections each (gate then up: 2), quantized per
    128 x 128 block: FP8 [E, stacked rows, cols], their scales stacked the same
    way, and the dequantized float32 weights."""
    weights, scales, dense = [], [], []
    for _ in range(experts):
        parts = []
        for _ in range(stacked):
            # Blocks of ranges a power of two apart, so a wrong block's scale shows.
            ranges = 2.0 ** torch.randint(-2, 3, (rows // 128, cols // 128), generator=g, device=DEVICE)
            spread = ranges.repeat_interleave(128, 0).repeat_interleave(128, 1)
            w = torch.randn(rows, cols, generator=g, device=DEVICE) * spread / cols**0.5
            parts.append(quantize_blocks(w, BLOCK))
        weights.append(torch.cat([p[0] for p in parts]))
        scales.append(torch.cat([p[1] for p in parts]))
        dense.append(torch.cat([WeightScales(s, BLOCK).dequantize(w) for w, s in parts]))
    return torch.stack(weights), torch.stack(scales).contiguous(), torch.stack(dense)


@pytest.mark.parametrize(
    ("tokens", "rank", "size", "ep", "shared"),
    [(1, 0, 1, False, False), (2, 0, 1, False, False), (2, 1, 2, False, False), (24, 0, 1, False, False),
     (256, 0, 1, False, False), (700, 0, 1, False, False), (256, 1, 2, False, False),
     (2, 1, 4, True, True), (256, 1, 4, True, True)],
)  # fmt: skip
def test_fp8_kernels_match_dequantize_then_matmul_in_a_cuda_graph(
    tokens: int, rank: int, size: int, ep: bool, shared: bool
) -> None:
    from tandem.engine.moe.fused import FusedMoE

    g = torch.Generator(device=DEVICE).manual_seed(tokens + rank)
    spec = MoESpec(E, K, INTER, True, (True,))
    shard = ExpertShard.of(spec, rank, size, expert_parallel=ep)
    local, inter = shard.num_local, shard.inter_size  # TP 2: 384, three whole blocks a rank
    w13, s13, dense13 = fp8_experts(local, inter, H, g, stacked=2)
    w2, s2, dense2 = fp8_experts(local, H, inter, g)
    assert w13.dtype == FP8 and s13.shape == (local, 2 * inter // 128, H // 128)
    x = torch.randn(tokens, H, generator=g, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, E, generator=g, device=DEVICE).bfloat16()
    extra = torch.randn(tokens, H, generator=g, device=DEVICE).bfloat16() if shared else None
    gate = torch.randn(tokens, 1, generator=g, device=DEVICE).bfloat16() if shared else None
    fused = FusedMoE(spec, shard, H)

    def run() -> torch.Tensor:
        out: torch.Tensor = fused(x, logits, w13, w2, extra, gate, False, s13=s13, s2=s2, fp8_block=BLOCK)
        return out

    def refill() -> None:
        x.copy_(torch.randn(tokens, H, generator=g, device=DEVICE).bfloat16())
        logits.copy_(torch.randn(tokens, E, generator=g, device=DEVICE).bfloat16())

    out = replay_captured(run, refill)
    weights, ids = reference_choice(logits.cpu(), K, renormalize=True)
    want = reference_experts(x, weights, ids, dense13, dense2, expert_start=shard.expert_start)
    if extra is not None and gate is not None:
        want = want + torch.sigmoid(gate.float()) * extra.float()
    assert relative_rms(out, want) < 1e-2


GREEDY_TOKENS = 24
FP8_NEAR_TIE = 0.5  # nats: the kernels scale in float32, the reference's weights are rounded to bf16


def _greedy(model_dir: Path, prompts: list[list[int]]) -> tuple[list[Any], Any]:
    llm = LLM(str(model_dir), device="cuda", cuda_graph_max_bs=16, num_pages=512)
    engine = llm.runtime.engine
    held = (engine.fp8_experts, [m.w13.dtype for m in engine.model.modules() if isinstance(m, MoEExperts)])
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, held


def test_an_fp8_moe_checkpoint_held_in_fp8_gives_its_dequantized_tokens(
    gpu_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """The experts alone are FP8 (attention kept bf16), so the two runs differ only in how the experts
    are held: FP8 with block scales in the kernels, or dequantized bf16."""
    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    src = gpu_model_dir("qwen3_moe")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    attention = tuple(f"model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo")
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", layout="block", block=BLOCK,
                         ignore=attention, reference_dtype=torch.bfloat16)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    held, held_as = _greedy(tmp_path / "fp8", prompts)
    dense, dense_as = _greedy(tmp_path / "ref", prompts)
    assert held_as == (BLOCK, [FP8] * layers) and dense_as == (None, [torch.bfloat16] * layers)
    assert not greedy_disagreements(dense, held, near_tie=FP8_NEAR_TIE)


QWEN3_30B_A3B = {
    "hidden_size": H,
    "intermediate_size": 6144,
    "moe_intermediate_size": INTER,
    "num_experts": E,
    "num_experts_per_tok": K,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "mlp_only_layers": [],
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def test_qwen3_30b_a3b_fp8_shape_holds_its_experts_in_fp8(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "qwen3-30b-a3b-fp8-shape"
    shutil.copytree(tiny_model_dir("qwen3_moe"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(QWEN3_30B_A3B)
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), load_format="dummy")
    try:
        engine = llm.runtime.engine
        experts = [m for m in engine.model.modules() if isinstance(m, MoEExperts)]
        assert engine.fp8_experts == BLOCK and len(experts) == 48
        assert all(m.w13.dtype == FP8 and m.w2.dtype == FP8 for m in experts)
        # FP8 experts: 48 x 128 x 3 x 2048 x 768 bytes = 27.0 GiB (54 GiB in bf16), with FP8 attention
        # and the bf16 embeddings and LM head about 29 GiB.
        gib = engine.weight_bytes / 2**30
        print(f"Qwen3-30B-A3B FP8 shape: weights {gib:.1f} GiB")
        assert 27 < gib < 31
        out = llm.generate(
            [[5, 6, 7], [8] * 40],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert [len(o.token_ids) for o in out] == [8, 8]
    finally:
        llm.shutdown()


DEEPSEEK_V3_FP8: dict[str, Any] = {  # V2-Lite's attention shape with a low-rank query, as V3's
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "n_group": 1,
    "topk_group": 1,
}


def test_an_fp8_deepseek_v3_serves_with_kv_b_proj_dequantized(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """A block-scaled FP8 DeepSeek-V3 (latent projections, experts and shared expert in FP8): its
    experts stay FP8 for the MoE kernels, its GEMM layers run FP8, and kv_b_proj, which the absorbed
    latent attention reads as W_UK and W_UV, stays bf16, read dequantized; under MLA decode and piecewise
    graphs it gives the eager torch-backend run's greedy tokens (up to FP8 near-ties), and its dummy form
    holds the same layout."""
    from tandem.engine.models.latent_attention import LatentAttention
    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 GEMMs of the latent projections need compute capability 9.0")
    write_fp8_checkpoint(tiny_model_dir("deepseek_v3", **DEEPSEEK_V3_FP8), tmp_path / "fp8", layout="block",
                         block=BLOCK)  # fmt: skip
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "fp8", bare, ignore=shutil.ignore_patterns("*.safetensors"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for name, options in {
        "eager": {"attention_backend": "torch", "cuda_graph": False, "piecewise_cuda_graph": False},
        "graphs": {"attention_backend": "flashinfer", "cuda_graph": True, "piecewise_cuda_graph": True},
        "dummy": {"load_format": "dummy"},
    }.items():
        model_dir = bare if name == "dummy" else tmp_path / "fp8"
        llm = LLM(str(model_dir), device="cuda", num_pages=512, cuda_graph_max_bs=16, **options)
        engine = llm.runtime.engine
        attention = [m for m in engine.model.modules() if isinstance(m, LatentAttention)]
        experts = [m for m in engine.model.modules() if isinstance(m, MoEExperts)]
        assert attention and all(m.kv_b_proj.weight.dtype == torch.bfloat16 for m in attention), name
        assert all(m.q_b_proj is not None and m.q_b_proj.weight.dtype == FP8 for m in attention), name
        # The torch-attention run has no fused (Triton) kernels, so its MoE takes the torch path on
        # dequantized experts; the flashinfer runs' Triton kernels read them in FP8.
        resident = FP8 if name != "eager" else torch.bfloat16
        assert experts and all(m.w13.dtype == resident for m in experts), name
        outs[name] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert all(len(o.token_ids) == GREEDY_TOKENS for o in outs["dummy"])
    assert not greedy_disagreements(outs["eager"], outs["graphs"], near_tie=FP8_NEAR_TIE)
