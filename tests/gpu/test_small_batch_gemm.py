"""The small-batch Triton GEMM on the GPU: against a float32 product on real layer shapes, inside a CUDA
graph, and end to end (greedy decode at batch <= 8 with the kernel on and off)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
# Llama-3.1-8B's q/k/v, o and down projections, Qwen3-0.6B's q/k/v, and a ragged N with a bias.
SHAPES = [
    (6144, 4096, False),
    (4096, 4096, False),
    (4096, 14336, False),
    (4096, 1024, False),
    (1000, 200, True),
]


@pytest.mark.parametrize("n,k,bias", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_matches_a_float32_product(m: int, n: int, k: int, bias: bool) -> None:
    pytest.importorskip("triton")
    from tandem.engine.layers.triton_gemv import SmallBatchGemm

    g = torch.Generator(device=DEVICE).manual_seed(m * n)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(BF16)
    w = (torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5).to(BF16)
    b = torch.randn(n, generator=g, device=DEVICE).to(BF16) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    got = SmallBatchGemm(DEVICE)(x, w, b)
    assert got.dtype == BF16 and got.shape == (m, n)
    # float32 accumulation, one bf16 rounding of the output: as close as cuBLAS gets.
    cublas = F.linear(x, w, b).float()
    limit = max(2 * (cublas - want).abs().max().item(), 2**-7 * want.abs().max().item())
    assert (got.float() - want).abs().max().item() <= limit


def test_replays_in_a_cuda_graph() -> None:
    pytest.importorskip("triton")
    from tandem.engine.layers.triton_gemv import SmallBatchGemm

    gemm = SmallBatchGemm(DEVICE)
    x = torch.randn(4, 4096, device=DEVICE, dtype=BF16)
    w = torch.randn(6144, 4096, device=DEVICE, dtype=BF16) * 0.02
    gemm(x, w, None)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm(x, w, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=2**-7, atol=2e-2)


def test_greedy_decode_at_small_batch_is_the_same_on_and_off(
    gpu_model_dir: Callable[[str], Path], assert_same_greedy: Callable[[list[Any], list[Any]], None]
) -> None:
    """Six prompts: every decode step has <= 8 rows, so the kernel runs every projection (graphs on)."""
    model_dir = gpu_model_dir("qwen3")
    g = torch.Generator().manual_seed(3)
    batch = [
        torch.randint(3, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 200, (6,), generator=g)
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for on in (True, False):
        llm = LLM(str(model_dir), device="cuda", num_pages=256, cuda_graph_max_bs=8, small_batch_gemm=on)
        assert llm.runtime.engine.config.small_batch_gemm is on
        outs[on] = llm.generate(batch, params, use_tqdm=False)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_greedy(outs[False], outs[True])
