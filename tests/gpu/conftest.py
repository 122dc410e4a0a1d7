"""Shared pieces of the GPU tests: model shapes, and a greedy comparison that tolerates bf16 near-ties.

Two bf16 runs that pad batches differently (CUDA graphs, piecewise buckets) or group rows differently
(overlap) use different GEMM and split-KV shapes, so their logits differ in the last bits and greedy
decoding may pick the other token where the top two are tied to within rounding. A real bug (a wrong
page, stale KV, a race) diverges where the top choice is clear. So two greedy runs "agree" when each
sequence is identical, or first differs at a step where the other run's token is within `NEAR_TIE`
nats of the reference's in the reference's own top logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch

# Real models' shapes, shrunk in depth (and vocab: the tiny tokenizer has 512 tokens).
QWEN3_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
GEMMA3_SHAPE: dict[str, Any] = {  # 5 sliding-window layers, then 1 global (Gemma 3's pattern)
    "hidden_size": 1152,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 32,  # small, so short tests evict pages
}
GEMMA2_SHAPE: dict[str, Any] = {  # attention soft-capping, alternating window/global layers
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
    "sliding_window": 32,
}
LLAMA_SHAPE: dict[str, Any] = {  # Llama-3.1-8B's head layout (GQA 4, no q/k norms), two layers
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
# Mixtures of experts with flashinfer's head size, so the graphs and fused kernels run: Qwen3-MoE's head
# layout and top 8 of 64 experts; Qwen2-MoE's shared expert with a dense layer 1; Mixtral's top 2 of 8.
QWEN3_MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "mlp_only_layers": [],
}
QWEN2_MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 1024,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
MIXTRAL_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
}
GPT_OSS_SHAPE: dict[str, Any] = {  # gpt-oss's head size and GQA, a window layer then a full one, top 4 of 8
    "hidden_size": 1024,
    "intermediate_size": 512,
    "num_local_experts": 8,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 32,
}
SHAPES = {
    "qwen3": QWEN3_SHAPE,
    "gemma3": GEMMA3_SHAPE,
    "gemma2": GEMMA2_SHAPE,
    "llama": LLAMA_SHAPE,
    "qwen3_moe": QWEN3_MOE_SHAPE,
    "qwen2_moe": QWEN2_MOE_SHAPE,
    "mixtral": MIXTRAL_SHAPE,
    "gpt_oss": GPT_OSS_SHAPE,
}
NEAR_TIE = 0.15  # nats


@pytest.fixture(scope="session")
def gpu_model_dir(tiny_model_dir: Callable[..., Path]) -> Callable[[str], Path]:
    """`gpu_model_dir(family) -> Path`: a bf16-sized random model of that family's real shape."""

    def build(family: str) -> Path:
        return tiny_model_dir(family, **SHAPES[family])

    return build


def greedy_disagreements(reference: list[Any], other: list[Any], near_tie: float = NEAR_TIE) -> list[str]:
    """Why `other` does not agree with `reference` (RequestOutputs with top logprobs); [] if it does:
    each first divergence must be at a step where `other`'s token is within `near_tie` nats."""
    problems = []
    for i, (ref, out) in enumerate(zip(reference, other)):
        if ref.token_ids == out.token_ids:
            continue
        step = next((j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)
        if step is None:
            problems.append(f"prompt {i}: lengths {len(ref.token_ids)} vs {len(out.token_ids)}")
            continue
        top = dict(ref.top_logprobs[step])
        chosen, alternative = ref.token_ids[step], out.token_ids[step]
        gap = top[chosen] - top[alternative] if alternative in top else float("inf")
        if gap > near_tie:
            problems.append(
                f"prompt {i}: step {step} took {alternative} over {chosen}, {gap:.3f} nats behind"
            )
    return problems


@pytest.fixture(name="greedy_disagreements")
def greedy_disagreements_fixture() -> Callable[..., list[str]]:
    return greedy_disagreements


@pytest.fixture
def assert_same_greedy() -> Callable[..., None]:
    def check(reference: list[Any], other: list[Any], near_tie: float = NEAR_TIE) -> None:
        assert len(reference) == len(other)
        problems = greedy_disagreements(reference, other, near_tie)
        # Only clear-choice divergences count. On the H200 (2026-11-29), 7 to 10 of 12 sequences took
        # the other branch at exact bf16 ties (the random 512-token models have flat logits), and
        # every first divergence was such a tie; a wrong page or a race diverges where the choice is clear.
        assert not problems, "\n".join(problems)

    return check


STALE_PAGE = 0  # tables never use page 0 for live tokens; evicted entries point at it


def replay_captured(run: Callable[[], torch.Tensor], refill: Callable[[], None]) -> torch.Tensor:
    """`run` once eagerly (its kernels build outside the capture), captured in a CUDA graph on a side
    stream, then replayed after `refill` wrote new inputs: the graph's output, synchronized."""
    run()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        out = run()
    refill()
    graph.replay()
    torch.cuda.synchronize()
    return out


def build_batch(
    ids: list[list[int]],
    spans: list[tuple[int, int]],
    tables: torch.Tensor,
    windows: list[int | None],
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Row b computes tokens [start, end) of ids[b] over the pages in tables[b] (host int32, the same
    page ids in every KV group). In a window group, kv_start is where the scheduler would evict to,
    and the table entries below it are stale: they point at STALE_PAGE."""
    starts = [s for s, _ in spans]
    ends = [e for _, e in spans]
    pos = torch.cat([torch.arange(s, e) for s, e in spans])
    row_of = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(spans)])
    loc = tables[row_of, pos // page_size].long() * page_size + pos % page_size
    groups = []
    for window in windows:
        keep = [0 if window is None else max(0, s - window + 1) // page_size * page_size for s in starts]
        table = tables.clone()
        for b, k in enumerate(keep):
            table[b, : k // page_size] = STALE_PAGE
        kv_start = torch.tensor(keep, dtype=torch.int32)
        groups.append(
            AttentionGroupBatch(table.to(device), kv_start.to(device), loc.to(device), kv_start, table)
        )
    seq = torch.tensor(ends, dtype=torch.int32)
    ext = torch.tensor([e - s for s, e in spans], dtype=torch.int32)
    tokens = torch.tensor([t for r, (s, e) in zip(ids, spans) for t in r[s:e]], dtype=torch.int64)
    return ForwardBatch(
        input_ids=tokens.to(device),
        positions=pos.to(device),
        seq_lens=seq.to(device),
        extend_lens=ext.to(device),
        seq_lens_cpu=seq,
        extend_lens_cpu=ext,
        groups=tuple(groups),
        sampling=SamplingBatch.greedy(len(spans), device),
        is_decode=bool((ext == 1).all()),
    )


def row_tables(num_rows: int, width: int, num_pages: int, seed: int) -> torch.Tensor:
    """Disjoint, shuffled pages (never page 0) for each row: int32 [rows, width]."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages - 1, generator=g)[: num_rows * width] + 1
    return pages.view(num_rows, width).to(torch.int32)


@pytest.fixture
def make_batch() -> Callable[..., ForwardBatch]:
    return build_batch


@pytest.fixture
def make_tables() -> Callable[..., torch.Tensor]:
    return row_tables
