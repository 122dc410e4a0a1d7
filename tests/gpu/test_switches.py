"""The same greedy tokens whatever the switches: overlap, copy stream, decode CUDA graphs,
piecewise CUDA graphs, chunked prefill (ties within bf16 rounding excepted; see conftest).

Switches that change the arithmetic itself (the attention backend, fused norm/rope kernels) round
differently everywhere, so a random bf16 model drifts by more than a near-tie: runs with those are
compared against an all-off run with the same arithmetic. Their own accuracy is checked against
float32 in test_flashinfer_model.py and test_fused_kernels.py."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Small pools and capture ranges keep each engine quick to build; batches still hit every path.
BASE: dict[str, Any] = {
    "device": "cuda",
    "num_pages": 512,
    "cuda_graph_max_bs": 16,
    "piecewise_max_tokens": 1024,
}
OFF: dict[str, Any] = {
    "overlap": False,
    "cuda_graph": False,
    "piecewise_cuda_graph": False,
    "copy_stream": False,
}
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5)
SETTINGS: list[dict[str, Any]] = [
    {},  # everything on: overlap, copy stream, decode graphs, piecewise graphs, flashinfer
    {"copy_stream": False},
    {"cuda_graph": False},
    {"piecewise_cuda_graph": False},
    {"overlap": False},
    {"chunk_size": 64},  # chunked prefill: decode rows ride along in piecewise-graph batches
    {"attention_backend": "torch"},  # piecewise graphs around the reference attention
    {"fused_kernels": False},  # torch norms and rope instead of flashinfer's fused kernels
]


def prompts(vocab: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 300, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


def run(model_dir: Path, batch: list[list[int]], **options: Any) -> list[Any]:
    llm = LLM(str(model_dir), **{**BASE, **options})
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert llm.stats()["kv_pages_used"] == 0
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


NUMERICS = ("attention_backend", "fused_kernels")
Reference = Callable[[dict[str, Any]], tuple[Path, list[list[int]], list[Any]]]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def reference(request: pytest.FixtureRequest, gpu_model_dir: Callable[[str], Path]) -> Reference:
    """`reference(setting)`: the all-off run with the setting's arithmetic, built once per arithmetic."""
    model_dir = gpu_model_dir(request.param)
    batch = prompts(512)
    runs: dict[tuple[Any, ...], list[Any]] = {}

    def get(setting: dict[str, Any]) -> tuple[Path, list[list[int]], list[Any]]:
        numerics = {k: v for k, v in setting.items() if k in NUMERICS}
        key = tuple(sorted(numerics.items()))
        if key not in runs:
            runs[key] = run(model_dir, batch, **OFF, **numerics)
        return model_dir, batch, runs[key]

    return get


@pytest.mark.parametrize(
    "setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "all-on"
)
def test_greedy_is_the_same_under_every_switch(
    reference: Reference,
    setting: dict[str, Any],
    assert_same_greedy: Callable[[list[Any], list[Any]], None],
) -> None:
    model_dir, batch, expected = reference(setting)
    outs = run(model_dir, batch, **setting)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_same_greedy(expected, outs)


def test_plans_switch_kernels_by_graph_size_and_match_eager(
    gpu_model_dir: Callable[[str], Path], assert_same_greedy: Callable[[list[Any], list[Any]], None]
) -> None:
    """Decode graphs of 1 to 64 rows, whose plans take the one-launch decode up to 32 rows and flashinfer
    above: the backend built the one-launch buffers for exactly the plans that chose it, and 40 sequences
    of uneven prompts (batches shrinking through 32 rows) give the all-off run's greedy tokens."""
    model_dir = gpu_model_dir("qwen3")
    batch = prompts(512, n=40, seed=1)
    expected = run(model_dir, batch, **OFF, num_pages=1024)  # room for all 40 at once
    llm = LLM(str(model_dir), **{**BASE, "num_pages": 1024, "cuda_graph_max_bs": 64})
    engine = llm.runtime.engine
    assert engine.decode_graphs is not None
    plans = engine.decode_graphs.plans
    assert max(plans) == 64 and [bs for bs, p in plans.items() if p.fused_decode] == [
        bs for bs in plans if bs <= 32
    ]
    built = {bs for fused in engine.attention._fused_by_size.values() for bs in fused}
    assert built == {bs for bs, p in plans.items() if p.fused_decode}
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_same_greedy(expected, outs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_graphs_with_nccl_inside_match_eager(
    gpu_model_dir: Callable[[str], Path], assert_same_greedy: Callable[[list[Any], list[Any]], None]
) -> None:
    """TP=2: NCCL all-reduces inside the decode CUDA graphs and the piecewise prefill graphs give the
    greedy tokens of the same TP=2 model run eagerly without overlap. Both sum the two ranks' partial
    products alike, so only bf16 near-ties from padded shapes may differ. (TP=2 against TP=1 rounds
    differently in every layer in bf16; test_replica_serve_gpu.py compares them in float32.)"""
    model_dir = gpu_model_dir("qwen3")
    batch = prompts(512)
    expected = run(model_dir, batch, tp_size=2, **OFF)
    outs = run(model_dir, batch, tp_size=2, chunk_size=64)  # every switch on, and chunked prefill
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_same_greedy(expected, outs)
