"""FP8 on the GPU: each FP8 GEMM (flashinfer's block-scaled one over block and per-channel scales, and
`_scaled_mm` after the one-launch per-token quantizer) against float32 on the same dequantized weights,
also inside a CUDA graph; an FP8 checkpoint and dynamic FP8 run with every switch on
(decode and piecewise graphs, Triton kernels) and give the greedy tokens of the same FP8 model run
eagerly, up to choices within FP8's rounding noise (`FP8_NEAR_TIE`); TP=2 (two GPUs) shards the scales
with the weights."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY_TOKENS = 32
# Dynamic FP8 rounds every activation to 3 mantissa bits per token. A last-bit difference in a GEMM's
# output (another kernel for another batch shape, as graphs' padded batches take) moves some elements
# across an FP8 rounding boundary, a step of up to 1/8 of their value; over the layers that turns bf16's
# last-bit noise into log-probability differences of a few tenths of a nat at the random models' flat
# choices. A wrong scale or a stale buffer in a graph is off by far more. The test checks this tolerance
# against the same eager model with other batch shapes.
FP8_NEAR_TIE = 0.5  # nats
# Per-channel weights run the block kernel up to 64 rows and `_scaled_mm` above (fp8_linear.py), which
# quantize activations per 128-column group and per token: a batch regrouped across that bound moves its
# logits further than one route's rounding. On the H200 a regrouped prefill moved a choice by 0.66 nats.
CHANNEL_NEAR_TIE = 1.0  # nats
OFF: dict[str, Any] = {"overlap": False, "cuda_graph": False, "piecewise_cuda_graph": False}


def _needs_fp8() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("rowwise-scaled FP8 GEMMs need compute capability 9.0")


@pytest.mark.parametrize("gemm", ["block", "block_channel", "scaled_mm", "channel"])
@pytest.mark.parametrize("rows", [1, 8, 200])
def test_fp8_matmul_matches_bf16_on_dequantized_weights(rows: int, gemm: str) -> None:
    """Each FP8 GEMM against float32 on the weights it dequantizes to, eagerly and replayed in a graph."""
    from tandem.engine.quant.fp8_format import dequantize, quantize_blocks, quantize_per_channel
    from tandem.engine.quant.fp8_linear import BlockScaledMatMul, ChannelScaledMatMul, ScaledMatMul

    _needs_fp8()
    if gemm != "scaled_mm" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("flashinfer's block-scaled FP8 GEMM is for SM90")
    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(1024, 4096, device="cuda", generator=g).bfloat16() * 0.02
    mm: BlockScaledMatMul | ChannelScaledMatMul | ScaledMatMul
    if gemm == "block":
        wq, scale = quantize_blocks(weight, (128, 128))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        reference = wq.float() * full
        mm = BlockScaledMatMul(scale)
    else:
        wq, channel = quantize_per_channel(weight)
        reference = dequantize(wq, channel)
        unit = torch.ones(8, 32, device="cuda")
        # "channel" is the engine's per-channel route: the block kernel up to 64 rows, then scaled_mm.
        if gemm == "channel":
            mm = ChannelScaledMatMul(channel, *weight.shape)
        else:
            mm = BlockScaledMatMul(unit, channel) if gemm == "block_channel" else ScaledMatMul(channel)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    got = mm(x, wq, None)
    want = x.float() @ reference.T
    rel = float((got.float() - want).norm() / want.norm())
    assert got.dtype == torch.bfloat16 and rel < 0.05, rel  # FP8 activations: a few % at most
    static_x, graph = x.clone(), torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mm(static_x, wq, None)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = mm(static_x, wq, None)
    graph.replay()
    assert torch.equal(out, got)


def _greedy(model_dir: Path, prompts: list[list[int]], **options: Any) -> tuple[list[Any], int]:
    from tandem import LLM, SamplingParams

    options = {"num_pages": 512, **options} if "num_pages" not in options else options
    llm = LLM(str(model_dir), device="cuda", cuda_graph_max_bs=16, **options)
    fp8_layers = llm.runtime.engine.fp8_layers
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, fp8_layers


def _prompts(n: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 500, (int(m),), generator=g).tolist()
        for m in torch.randint(5, 300, (n,), generator=g)
    ]


@pytest.mark.parametrize("layout", ["block", "channel", "dynamic"])
def test_fp8_graphs_match_fp8_eager(
    layout: str,
    gpu_model_dir: Callable[[str], Path],
    tmp_path: Path,
    assert_same_greedy: Callable[..., None],
) -> None:
    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    _needs_fp8()
    model_dir, extra = gpu_model_dir("qwen3"), {"quantization": "fp8"}
    if layout != "dynamic":
        write_fp8_checkpoint(model_dir, tmp_path / "fp8", layout=layout, block=(128, 128))  # type: ignore[arg-type]
        model_dir, extra = tmp_path / "fp8", {}
    prompts = _prompts()
    expected, eager_layers = _greedy(model_dir, prompts, **OFF, **extra)
    outs, layers = _greedy(model_dir, prompts, **extra)
    assert layers == eager_layers == 4 * 2  # qkv, o, gate/up and down in both layers
    assert all(len(o.token_ids) == GREEDY_TOKENS for o in outs)
    # FP8's own noise: the same eager model four prompts at a time, so its GEMMs take other shapes.
    regrouped, _ = _greedy(model_dir, prompts, **OFF, **extra, max_running=4)
    near_tie = FP8_NEAR_TIE if layout == "block" else CHANNEL_NEAR_TIE
    assert_same_greedy(expected, regrouped, near_tie)  # else the tolerance is below FP8's own noise
    assert_same_greedy(expected, outs, near_tie)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fp8_tp2_matches_tp2_eager(
    gpu_model_dir: Callable[[str], Path],
    tmp_path: Path,
    assert_same_greedy: Callable[[list[Any], list[Any]], None],
) -> None:
    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    _needs_fp8()
    write_fp8_checkpoint(gpu_model_dir("qwen3"), tmp_path / "fp8", layout="block")
    prompts = _prompts()
    expected, _ = _greedy(tmp_path / "fp8", prompts, tp_size=2, **OFF)
    outs, _ = _greedy(tmp_path / "fp8", prompts, tp_size=2)
    assert_same_greedy(expected, outs)


def test_fp8_kv_cache_doubles_the_pool_and_graphs_match_eager(
    gpu_model_dir: Callable[[str], Path], assert_same_greedy: Callable[[list[Any], list[Any]], None]
) -> None:
    """kv_cache_dtype="fp8_e4m3": flashinfer reads the FP8 pool (scales 1.0) in decode graphs and piecewise
    prefill as it does eagerly, and a pool sized from free memory holds about twice the pages."""
    from tandem import LLM

    model_dir = gpu_model_dir("qwen3")
    prompts = _prompts()
    expected, _ = _greedy(model_dir, prompts, kv_cache_dtype="fp8_e4m3", **OFF)
    outs, _ = _greedy(model_dir, prompts, kv_cache_dtype="fp8_e4m3")
    assert_same_greedy(expected, outs)
    pages = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(
            str(model_dir), device="cuda", kv_cache_dtype=kv, cuda_graph=False, piecewise_cuda_graph=False
        )
        pages[kv] = llm.runtime.engine.groups[0].num_pages
        assert llm.runtime.engine.pool.fp8 == (kv != "auto")
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.9 < pages["fp8_e4m3"] / pages["auto"] < 2.1, pages


def test_a_dummy_fp8_checkpoint_runs_its_layers_in_fp8(
    gpu_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """`load_format="dummy"` on a block-scaled FP8 config: every linear layer is FP8 in the config's
    blocks, as the real checkpoint's would be, so benchmarks of FP8 shapes run FP8 kernels."""
    import json
    import shutil

    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    _needs_fp8()
    write_fp8_checkpoint(gpu_model_dir("qwen3"), tmp_path / "fp8", layout="block", block=(128, 128))
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "fp8", bare, ignore=shutil.ignore_patterns("*.safetensors"))
    assert json.loads((bare / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]
    outs, layers = _greedy(bare, _prompts(4), load_format="dummy")
    assert layers == 4 * 2
    assert all(len(o.token_ids) == GREEDY_TOKENS for o in outs)
