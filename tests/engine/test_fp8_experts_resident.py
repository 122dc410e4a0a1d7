"""Block-scaled FP8 experts held as FP8 (the layout the Triton kernels read on CUDA), checked on CPU:
loading a checkpoint's weights and `weight_scale_inv` into it (this rank's rows of gate/up and columns
of down with the scale blocks that cover them, TP's slices and EP's whole experts) holds exactly the
values the dequantizing load holds; a whole tiny Qwen3-MoE held that way (its torch path dequantizes
per expert) gives HF's greedy tokens on the dequantized weights, and `Engine.weight_bytes` counts the
FP8 bytes; `load_format="dummy"` draws the FP8 layout (a DeepSeek-V3's too, its kv_b_proj dense);
where the engine holds them so."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.layers.source import InMemorySource
from tandem.engine.models.latent_attention import LatentAttention
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.fp8_export import write_fp8_checkpoint
from tandem.engine.quant.fp8_format import FP8, DequantSource, Fp8Checkpoint, quantize_blocks

from .moe_ranks import CHUNK, MAX_NEW
from .test_fp8_experts import BLOCK, fp8_case

E, H, INTER = 4, 64, 64


@pytest.fixture
def resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine chooses on CUDA with Triton: the experts stay FP8 (here on CPU)."""
    monkeypatch.setattr(Fp8Checkpoint, "expert_block", lambda self, device, *, triton: self.block)


@pytest.mark.parametrize(
    ("block", "rank", "size", "ep"),
    [((16, 16), 0, 1, False), ((16, 32), 1, 2, False), ((32, 16), 0, 2, False), ((16, 16), 1, 2, True),
     ((24, 16), 0, 1, False)],  # a block of 24 rows: the last of each projection is partial
)  # fmt: skip
def test_fp8_layout_holds_the_dequantized_values(
    block: tuple[int, int], rank: int, size: int, ep: bool
) -> None:
    spec = MoESpec(E, 2, INTER, True, (True,))
    shard = ExpertShard.of(spec, rank, size, expert_parallel=ep)
    cpu = torch.device("cpu")
    held = MoEExperts(spec, shard, H, dtype=torch.float32, device=cpu, fp8_block=block)
    dense = MoEExperts(spec, shard, H, dtype=torch.float32, device=cpu)
    g = torch.Generator().manual_seed(rank + 2 * ep)
    for expert in range(E):
        for kind, shape in enumerate([(INTER, H), (INTER, H), (H, INTER)]):
            w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)
            wq, scales = quantize_blocks(w, block)
            name = f"experts.{expert}.{kind}.weight"
            for module in (held, dense):
                source = DequantSource(InMemorySource(name, wq), InMemorySource(name, scales), block)
                module.load(source, 3 * expert + kind, is_bias=False)
    assert held.w13.dtype == held.w2.dtype == FP8
    assert held.w13_scales is not None and held.w2_scales is not None
    for local in range(shard.num_local):
        w13, w2 = held.expert_weights(local)
        assert torch.equal(w13, dense.w13[local]) and torch.equal(w2, dense.w2[local])
    # FP8 bytes and block scales in place of float32 weights.
    assert held.w13.nbytes * 4 == dense.w13.nbytes and held.w2.nbytes * 4 == dense.w2.nbytes


def test_a_weight_without_its_block_scales_fails_by_name() -> None:
    spec = MoESpec(E, 2, INTER, True, (True,))
    shard = ExpertShard.of(spec, 0, 1, expert_parallel=False)
    held = MoEExperts(spec, shard, H, dtype=torch.float32, device=torch.device("cpu"), fp8_block=(16, 16))
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    with pytest.raises(ValueError, match=r"expert 1's up_proj: .*weight_scale_inv"):
        held.load(InMemorySource(name, torch.randn(INTER, H)), 3 + 1, is_bias=False)


@pytest.fixture(scope="module")
def fp8_moe(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fp8_case(tiny_model_dir("qwen3_moe"), tmp_path_factory.mktemp("fp8-resident"))


def test_a_tiny_qwen3_moe_held_in_fp8_matches_hf(
    fp8_moe: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Fp8Checkpoint, "expert_block", lambda self, device, *, triton: self.block)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    llm = LLM(str(fp8_moe["dir"]), device="cpu", chunk_size=CHUNK)
    engine = llm.runtime.engine
    experts = [m for m in engine.model.modules() if isinstance(m, MoEExperts)]
    assert engine.fp8_experts == BLOCK and experts
    assert all(m.w13.dtype == FP8 and m.w2.dtype == FP8 for m in experts)
    outs = llm.generate(fp8_moe["prompts"], greedy, use_tqdm=False)
    held_bytes = engine.weight_bytes
    llm.shutdown()
    assert [o.token_ids for o in outs] == fp8_moe["want"]
    # The weight bytes count the experts as held: 1 byte a weight and 4 a block scale, not 4 a weight.
    monkeypatch.undo()  # the dequantizing load, as on CPU
    dense = LLM(str(fp8_moe["dir"]), device="cpu", chunk_size=CHUNK)
    dense_bytes = dense.runtime.engine.weight_bytes
    dense.shutdown()
    scale_bytes = sum(m.w13_scales.nbytes + m.w2_scales.nbytes for m in experts if m.w13_scales is not None
                      and m.w2_scales is not None)  # fmt: skip
    weights = sum(m.w13.numel() + m.w2.numel() for m in experts)
    assert held_bytes == dense_bytes - 3 * weights + scale_bytes


@pytest.mark.usefixtures("resident")
def test_dummy_weights_draw_the_fp8_layout(fp8_moe: dict[str, Any]) -> None:
    llm = LLM(str(fp8_moe["dir"]), device="cpu", load_format="dummy")
    try:
        experts = [m for m in llm.runtime.engine.model.modules() if isinstance(m, MoEExperts)]
        assert experts and all(m.w13.dtype == FP8 for m in experts)
        w13, w2 = experts[0].expert_weights(0)
        # N(0, 1 / fan_in), as the dense draw is.
        assert 0.5 < float(w13.float().std()) * H**0.5 < 2 and 0.5 < float(w2.float().std()) * 32**0.5 < 2
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("resident")
def test_a_dummy_fp8_deepseek_holds_fp8_experts_and_a_dense_kv_b_proj(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """`load_format="dummy"` on a block-scaled FP8 DeepSeek-V3 config: the experts drawn in FP8, and
    kv_b_proj in the compute dtype, outside the layers made FP8 (the absorbed attention reads it)."""
    write_fp8_checkpoint(tiny_model_dir("deepseek_v3"), tmp_path / "fp8", layout="block", block=BLOCK)
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "fp8", bare, ignore=shutil.ignore_patterns("*.safetensors"))
    llm = LLM(str(bare), device="cpu", load_format="dummy")
    try:
        model = llm.runtime.engine.model
        attention = [m for m in model.modules() if isinstance(m, LatentAttention)]
        experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
        assert experts and all(m.w13.dtype == FP8 for m in experts)
        assert attention and all(m.kv_b_proj.weight.dtype == torch.float32 for m in attention)
        assert not any(m.kv_b_proj in model.linear_layers() for m in attention)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_experts_stay_fp8_only_where_the_kernels_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    block = Fp8Checkpoint.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert block is not None
    assert block.expert_block(torch.device("cuda"), triton=True) == (128, 128)
    capability[0] = (8, 0)  # Ampere: Triton has no FP8 conversion there
    assert block.expert_block(torch.device("cuda"), triton=True) is None
    capability[0] = (9, 0)
    assert block.expert_block(torch.device("cuda"), triton=False) is None
    assert block.expert_block(torch.device("cpu"), triton=True) is None
    odd = Fp8Checkpoint.from_config({"quant_method": "fp8", "weight_block_size": [128, 96]})
    assert odd is not None and odd.expert_block(torch.device("cuda"), triton=True) is None
    mixed = Fp8Checkpoint.from_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.0.mlp.experts"],
        }
    )
    assert mixed is not None and mixed.expert_block(torch.device("cuda"), triton=True) is None
    channel = Fp8Checkpoint.from_config({"quant_method": "compressed-tensors", "format": "float-quantized"})
    assert channel is not None and channel.expert_block(torch.device("cuda"), triton=True) is None
