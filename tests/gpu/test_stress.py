"""A tight KV pool with overlap, decode and piecewise CUDA graphs, and window eviction (or
prefix-cache eviction) all at once. Pages are freed and reused constantly, so a page handed out while
an in-flight batch may still read it would show: `guard_inflight_pages` asserts on it, and the outputs
must match a run with overlap and graphs off."""

from __future__ import annotations

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

COMMON: dict[str, Any] = {"device": "cuda", "page_size": 16, "chunk_size": 32, "max_running": 16}
FAST: dict[str, Any] = {
    "overlap": True,
    "cuda_graph": True,
    "piecewise_cuda_graph": True,
    "cuda_graph_max_bs": 16,
    "piecewise_max_tokens": 256,
    "guard_inflight_pages": True,
}
SLOW: dict[str, Any] = {"overlap": False, "cuda_graph": False, "piecewise_cuda_graph": False}


def workload(family: str, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(11)
    n = 40
    if family == "qwen3":  # shared prefixes: the radix cache holds, evicts and hands pages back out
        heads = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(4)]
        batch = [
            heads[i % 4]
            + torch.randint(3, vocab, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist()
            for i in range(n)
        ]
    else:  # long prompts and outputs over a 32-token window: window pages are evicted every few steps
        batch = [
            torch.randint(3, vocab, (int(torch.randint(20, 400, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)
        ]
    lengths = torch.randint(16, 96, (n,), generator=g).tolist()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=5) for m in lengths]
    return batch, params


@pytest.mark.parametrize(("family", "num_pages"), [("gemma3", 160), ("qwen3", 120)])
def test_tight_pool_with_everything_on(
    family: str,
    num_pages: int,
    gpu_model_dir: Callable[[str], Path],
    assert_same_greedy: Callable[[list[Any], list[Any]], None],
) -> None:
    model_dir = str(gpu_model_dir(family))
    batch, params = workload(family, 512)
    outputs = []
    for switches in (SLOW, FAST):
        llm = LLM(model_dir, num_pages=num_pages, **COMMON, **switches)
        outputs.append(llm.generate(batch, params, use_tqdm=False))
        stats = llm.stats()
        assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0
        if family == "gemma3":  # window pages really were recycled: the window group peaked far lower
            full_peak, window_peak = stats["kv_pages_peak_per_group"]
            assert window_peak < full_peak / 2
        llm.shutdown()
    slow, fast = outputs
    assert [len(o.token_ids) for o in fast] == [p.max_tokens for p in params]
    assert_same_greedy(slow, fast)
