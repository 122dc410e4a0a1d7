"""Time decode steps straight through the Engine: hand-built batches at fixed contexts over a KV pool
of random values, so long contexts cost no prefill. A step is `Engine.forward` (plan, graph or eager
forward, sampling, result copy), pipelined one step deep as the overlap loop runs it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import sync
from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.streams import StreamSet

PAGE = 16


def build_engine(
    model_dir: Path,
    device: torch.device,
    *,
    num_pages: int,
    cuda_graph: bool,
    max_bs: int,
    fused_decode_max_bs: int | None = None,
    options: dict[str, Any] | None = None,
) -> Engine:
    """An engine for decode timings; `fused_decode_max_bs` None keeps the engine's default, `options`
    are more of resolve_engine_config's keywords."""
    extra = dict(options or {})
    if fused_decode_max_bs is not None:
        extra["fused_decode_max_bs"] = fused_decode_max_bs
    config = resolve_engine_config(
        model_dir,
        device=str(device),
        page_size=PAGE,
        num_pages=num_pages,
        cuda_graph=cuda_graph,
        piecewise_cuda_graph=False,  # decode only
        cuda_graph_max_bs=max_bs,
        **extra,
    )
    engine = Engine(config, TPGroup(), StreamSet(config.device))
    gen = torch.Generator(device=config.device).manual_seed(0)
    for cache in (*engine.pool.k.values(), *engine.pool.v.values()):
        cache.normal_(generator=gen)  # never time on zeros
    return engine


def sampling(batch: int, device: torch.device) -> SamplingBatch:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperature=full(0.6),
        top_p=full(1.0),
        top_k=full(0, torch.int64),
        min_p=full(0.0),
        seeds=torch.arange(batch, device=device),
        steps=full(0, torch.int64),
        presence_penalty=full(0.0),
        frequency_penalty=full(0.0),
        repetition_penalty=full(1.0),
        # The host flags the batch builder sets for these rows (temperature only: no top-k/top-p, no
        # min-p, no per-request seed), so the sampler runs as it does in serving. Left at their
        # conservative defaults, they made every step sort the whole vocabulary and run the seeded hash.
        any_top_k_top_p=False,
        any_min_p=False,
        any_explicit_seed=False,
        any_greedy=False,
    )


def decode_batch(engine: Engine, contexts: list[int], *, evict: bool = True) -> ForwardBatch:
    """One decode row per context c: its query at position c - 1 over c tokens of KV. Rows hold
    disjoint random pages. With `evict`, window groups start where the scheduler would have evicted
    to, and the table entries below that are stale (page 0)."""
    device = engine.config.device
    width = -(-max(contexts) // PAGE)
    needed = sum(-(-c // PAGE) for c in contexts)
    pages = torch.randperm(engine.groups[0].num_pages - 1)[:needed] + 1
    table = torch.zeros(len(contexts), width, dtype=torch.int32)
    offset = 0
    for b, c in enumerate(contexts):
        n = -(-c // PAGE)
        table[b, :n] = pages[offset : offset + n].to(torch.int32)
        offset += n
    pos = torch.tensor([c - 1 for c in contexts])
    loc = table[torch.arange(len(contexts)), pos // PAGE].long() * PAGE + pos % PAGE
    groups = []
    for spec in engine.groups:
        starts = [0] * len(contexts)
        if spec.window is not None and evict:
            starts = [max(0, c - spec.window) // PAGE * PAGE for c in contexts]
        rows = table.clone()
        for b, s in enumerate(starts):
            rows[b, : s // PAGE] = 0
        kv_start = torch.tensor(starts, dtype=torch.int32)
        groups.append(
            AttentionGroupBatch(rows.to(device), kv_start.to(device), loc.to(device), kv_start, rows)
        )
    seq = torch.tensor(contexts, dtype=torch.int32)
    ones = torch.ones(len(contexts), dtype=torch.int32)
    ids = torch.randint(0, min(10000, engine.model_config.vocab_size), (len(contexts),))
    return ForwardBatch(
        input_ids=ids.to(device),
        positions=pos.to(device),
        seq_lens=seq.to(device),
        extend_lens=ones.to(device),
        seq_lens_cpu=seq,
        extend_lens_cpu=ones,
        groups=tuple(groups),
        sampling=sampling(len(contexts), device),
        is_decode=True,
    )


def seconds_per_step(engine: Engine, batch: ForwardBatch, *, steps: int, repeats: int = 3) -> float:
    """Median over `repeats` of wall time per step across `steps` pipelined steps."""
    for _ in range(3):
        engine.forward(batch).copy_done.synchronize()
    results = []
    for _ in range(repeats):
        sync(engine.config.device)
        start = time.perf_counter()
        previous = None
        for _ in range(steps):
            output = engine.forward(batch)
            if previous is not None:
                previous.copy_done.synchronize()  # results are read one step late, as in the overlap loop
            previous = output
        assert previous is not None
        previous.copy_done.synchronize()
        results.append((time.perf_counter() - start) / steps)
    return statistics.median(results)
