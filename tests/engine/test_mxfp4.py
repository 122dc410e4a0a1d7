"""MXFP4 checkpoints (gpt-oss on the hub): the dequantization matches transformers'
`convert_moe_packed_tensors`; a tiny gpt-oss written in the MXFP4 layout by an independent quantizer
gives HF's greedy tokens on the dequantized weights; `load_format="dummy"` draws both layouts; a
quantization tandem does not load fails at load, naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tandem import LLM, SamplingParams
from tandem.engine.layers.source import InMemorySource
from tandem.engine.quant.mxfp4 import Mxfp4Source

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 magnitudes by code


def quantize(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32], the values they
    hold [..., K]), written out element by element: each 32 values get the power of two that brings
    their largest magnitude to at most 6, each value the nearest grid point (ties to the lower)."""
    *lead, k = dense.shape
    groups = dense.reshape(-1, k // 32, 32).tolist()
    blocks, scales, values = [], [], []
    for row in groups:
        for group in row:
            amax = max(abs(v) for v in group) or 1.0
            exponent = 0
            while amax / 2.0**exponent > 6.0:
                exponent += 1
            while exponent > -20 and amax / 2.0 ** (exponent - 1) <= 6.0:
                exponent -= 1
            codes = []
            for v in group:
                m = abs(v) / 2.0**exponent
                code = min(range(8), key=lambda c: (abs(GRID[c] - m), c))
                codes.append(code | (8 if v < 0 and GRID[code] != 0 else 0))
                values.append((-1 if codes[-1] & 8 else 1) * GRID[code] * 2.0**exponent)
            blocks.append([codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)])
            scales.append(exponent + 127)
    shape = (*lead, k // 32)
    return (
        torch.tensor(blocks, dtype=torch.uint8).reshape(*shape, 16),
        torch.tensor(scales, dtype=torch.uint8).reshape(shape),
        torch.tensor(values, dtype=torch.float32).reshape(*lead, k),
    )


def test_dequantization_matches_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 10, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    source = Mxfp4Source(InMemorySource("x_blocks", blocks), InMemorySource("x_scales", scales))
    assert source.shape == tuple(want.shape)
    assert torch.equal(source.read(), want)
    assert torch.equal(source.read(0, 1, 2), want[1:3])  # one rank's experts, dequantized alone
    assert torch.equal(source.read(2, 3, 4), want[:, :, 3:7])


def test_independent_quantizer_agrees_with_transformers() -> None:
    dense = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 0.3
    blocks, scales, values = quantize(dense)
    assert torch.equal(
        convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), values.transpose(1, 2)
    )
    assert torch.allclose(values, dense, atol=0.2) and not torch.equal(values, dense)


def write_mxfp4(model_dir: Path, dense_out: Path, mxfp4_out: Path) -> None:
    """The tiny model's experts quantized: `mxfp4_out` holds blocks and scales, `dense_out` the values
    they dequantize to in transformers' layout (what HF runs)."""
    for out in (dense_out, mxfp4_out):
        shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(model_dir / "model.safetensors")
    dense, packed = dict(weights), dict(weights)
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = quantize(tensor.transpose(1, 2).contiguous())  # packed along the input
            dense[name] = values.transpose(1, 2).contiguous()
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(dense, str(dense_out / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(mxfp4_out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4_out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
    }
    (mxfp4_out / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_matches_hf_on_the_dequantized_weights(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    write_mxfp4(tiny_model_dir("gpt_oss"), tmp_path / "dense", tmp_path / "mxfp4")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 7)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager").eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    llm = LLM(str(tmp_path / "mxfp4"), device="cpu", chunk_size=16)
    try:
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    finally:
        llm.shutdown()
    # The quantization matters: HF on the original weights differs.
    original = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt_oss"), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        before = [
            original.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    assert before != want


def test_mxfp4_tp2_and_expert_parallel_match_hf(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Each rank dequantizes only its shard: a slice of every expert (TP) or its own experts (EP)."""

    from .moe_ranks import MAX_NEW, moe_two_ranks

    write_mxfp4(tiny_model_dir("gpt_oss"), tmp_path / "dense", tmp_path / "mxfp4")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 4)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager").eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    jobs = {"mxfp4": (str(tmp_path / "mxfp4"), prompts)}
    results = moe_two_ranks(jobs)
    for rank in (0, 1):
        for mode in ("tp", "ep"):
            assert results[rank][f"mxfp4/{mode}"]["tokens"] == want, (rank, mode)


@pytest.mark.parametrize("quantized", [False, True])
def test_dummy_weights_draw_both_layouts(
    quantized: bool, tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    if quantized:
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), device="cpu", load_format="dummy")
    try:
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_unsupported_quantization_is_named(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        LLM(str(model_dir), device="cpu")


def test_mxfp4_outside_the_experts_is_named(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(tiny_model_dir("gpt_oss") / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    blocks, scales, _ = quantize(weights.pop(name).unsqueeze(0))
    weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks[0], scales[0]
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"o_proj\.weight_blocks' is not an MoE expert projection"):
        LLM(str(model_dir), device="cpu")
