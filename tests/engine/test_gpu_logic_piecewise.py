"""The GPU path, checked on CPU: the piecewise runner's pieces, static buffers and padding, run eagerly.

On CPU the runner executes its pieces without capturing them (`use_graphs=False`), over the same
static buffers the GPU graphs use, so this checks the plumbing the graphs replay: the chain of
pieces, q/k/v and hidden-state hand-offs, and padded rows past the batch's token count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.models.context import ForwardContext
from tandem.engine.piecewise_graph import PiecewiseGraphRunner
from tandem.engine.streams import StreamSet

PAGE = 4


def make_batch(engine: Engine, ids: list[list[int]], starts: list[int]) -> ForwardBatch:
    """Rows computing ids[b][starts[b]:], each on its own disjoint pages (page 0 left unused)."""
    width = max(-(-len(r) // PAGE) for r in ids)
    table = torch.stack(
        [torch.arange(1 + b * width, 1 + (b + 1) * width, dtype=torch.int32) for b in range(len(ids))]
    )
    pos = torch.cat([torch.arange(s, len(r)) for r, s in zip(ids, starts)])
    rows = torch.cat([torch.full((len(r) - s,), b) for b, (r, s) in enumerate(zip(ids, starts))])
    loc = table[rows, pos // PAGE].long() * PAGE + pos % PAGE
    zero = torch.zeros(len(ids), dtype=torch.int32)
    group = AttentionGroupBatch(table, zero, loc, zero, table)
    seq = torch.tensor([len(r) for r in ids], dtype=torch.int32)
    ext = torch.tensor([len(r) - s for r, s in zip(ids, starts)], dtype=torch.int32)
    tokens = torch.tensor([t for r, s in zip(ids, starts) for t in r[s:]])
    is_decode = bool((ext == 1).all())
    return ForwardBatch(
        tokens,
        pos,
        seq,
        ext,
        seq,
        ext,
        (group,) * len(engine.groups),
        SamplingBatch.greedy(len(ids)),
        is_decode,
    )


# gpt-oss: the sinks reach attention; DeepSeek: latent attention's pieces
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt_oss", "deepseek_v2", "deepseek_v3"])
def test_pieces_over_padded_buffers_match_the_eager_forward(tiny_model_dir, family: str) -> None:  # type: ignore[no-untyped-def]
    model_dir: Path = tiny_model_dir(family)
    config = resolve_engine_config(model_dir, device="cpu", page_size=PAGE, num_pages=128)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    runner = PiecewiseGraphRunner(engine.model, max_tokens=96, device=torch.device("cpu"), use_graphs=False)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 45, 13)]
    ctx = ForwardContext(engine.attention, engine.pool)
    with torch.inference_mode():
        # A prefill, then an extend over the cached prefix, then a decode step.
        for starts in ([0, 0, 0], [5, 30, 12], [6, 44, 12]):
            batch = make_batch(engine, ids, starts)
            bucket = runner.padded_size(batch)
            assert bucket is not None and bucket >= batch.num_tokens
            engine.attention.plan(batch)
            expected = engine.model(batch.input_ids, batch.positions, ctx).clone()
            got = runner.run(batch, ctx, bucket)
            # Not bitwise: BLAS picks different kernels for 3 rows and for 8 padded rows.
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    too_big = make_batch(engine, [list(range(3, 110))], [0])
    assert runner.padded_size(too_big) is None
