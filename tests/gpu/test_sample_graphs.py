"""The one-pass race replayed from CUDA graphs (engine/sample_graphs.py) draws exactly the eager race's
tokens, plain and with structured-output rows, whatever the rows before it left in the static buffers;
and an engine with decode graphs draws its decode steps through them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.batch import SamplingBatch
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.sample_graphs import SampleGraphs
from tandem.engine.sampler import Sampler
from tandem.scheduler.sampling_params import StructuredOutputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")
HEAD, VOCAB, TOKENIZER = 2048, 2000, 1500  # a padded head; the tokenizer's ids end mid-word (1500 % 32)


def _batch(rows: int, seed: int, constrained: list[int] | None = None) -> SamplingBatch:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    temps = torch.rand(rows, generator=g, device=DEVICE) + 0.3
    temps[::3] = 0.0  # greedy rows ride along
    batch = dataclasses.replace(
        SamplingBatch.greedy(rows, DEVICE),
        temperature=temps,
        seeds=torch.randint(-(2**40), 2**40, (rows,), generator=g, device=DEVICE),
        steps=torch.randint(0, 5000, (rows,), generator=g, device=DEVICE),
        all_greedy=False,
        any_greedy=True,
    )
    if constrained is None:
        return batch
    # Random 30% masks, every bit of the last word set past the tokenizer's ids: they must stay blocked.
    words = -(-TOKENIZER // 32)
    bits = torch.rand(len(constrained), words * 32, generator=g, device=DEVICE) < 0.3
    bits[:, TOKENIZER:] = True
    weights = 2 ** torch.arange(32, dtype=torch.int64, device=DEVICE)
    packed = (bits.view(-1, words, 32).long() * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows_t = torch.tensor(constrained, dtype=torch.int64, device=DEVICE)
    return dataclasses.replace(batch, bitmask=packed, bitmask_rows=rows_t, bitmask_vocab=TOKENIZER)


def test_graphs_draw_the_eager_race_tokens() -> None:
    kernels = FusedKernels(max_positions=1024)
    assert kernels.race_sample is not None  # CUDA builds of torch bring Triton
    sampler = Sampler(VOCAB, device=DEVICE, race=kernels.race_sample)
    assert sampler.warm_up(torch.bfloat16) is None
    sizes = [1, 2, 4, 8, 16]
    logits = torch.empty(sizes[-1], HEAD, dtype=torch.bfloat16, device=DEVICE)
    graphs = SampleGraphs(sampler.race_call, logits, sizes, VOCAB)
    graphs.capture()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    # Masked batches first with many rows, then with fewer: stale static rows must not leak.
    cases = [(16, [0, 3, 4, 9, 15]), (5, [1]), (13, None), (8, [2, 7]), (1, None), (1, [0]), (3, [0, 1, 2])]
    for i, (rows, constrained) in enumerate(cases):
        logits.copy_((torch.randn(sizes[-1], HEAD, generator=g, device=DEVICE) * 3).to(torch.bfloat16))
        batch = _batch(rows, seed=i, constrained=constrained)
        assert sampler.takes_race(batch) and graphs.fits(batch)
        eager = sampler(logits[:rows], batch).next_tokens
        graph_bs = min(s for s in sizes if s >= rows)
        drawn = graphs.run(batch, rows, graph_bs)
        assert torch.equal(drawn, eager), (rows, constrained, drawn.tolist(), eager.tolist())
        if constrained is not None:
            assert bool((drawn[constrained] < TOKENIZER).all())


def test_engine_decode_steps_sample_through_the_graphs(gpu_model_dir: Callable[[str], Path]) -> None:
    """Plain and structured rows: the tokens are those of the same engine with the graphs taken away
    (no prefix cache, so both runs run the same shapes and make the same logits)."""
    llm = LLM(
        str(gpu_model_dir("qwen3")), device="cuda", num_pages=256, cuda_graph_max_bs=8, prefix_cache=False
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    plain = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    json_row = SamplingParams(
        max_tokens=24, temperature=0.8, seed=3, structured_outputs=StructuredOutputs(json=schema)
    )
    prompts = [[5, 6, 7], [9, 10], [11], [12, 13]]
    params = [
        plain,
        json_row,
        SamplingParams(max_tokens=16, temperature=0.5, seed=11, ignore_eos=True),
        json_row,
    ]
    try:
        engine = llm.runtime.engine
        graphs = engine.sample_graphs
        assert graphs is not None
        replays = 0
        run = graphs.run

        def counted(*args: Any) -> torch.Tensor:
            nonlocal replays
            replays += 1
            return run(*args)

        graphs.run = counted  # type: ignore[method-assign,assignment]
        through_graphs = llm.generate(prompts, params, use_tqdm=False)
        engine.sample_graphs = None
        eager = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert replays >= 15, "decode steps did not sample through the graphs"
    assert [o.token_ids for o in through_graphs] == [o.token_ids for o in eager]
    for out in through_graphs[1::2]:
        json.loads(out.text)
