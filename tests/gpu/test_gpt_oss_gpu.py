"""gpt-oss on the GPU: flashinfer attention with the sink epilogue (eager, under decode CUDA graphs and
under piecewise graphs) and the MoE's torch path, against the torch attention backend's sink softmax, in
bf16 against a float32 truth, over prefill, extend, decode steps with window eviction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.streams import StreamSet

from .test_flashinfer_model import LENGTHS, NUM_PAGES, PAGE, STEPS, close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def engines(gpu_model_dir: Callable[[str], Path]) -> dict[str, Engine]:
    model_dir = gpu_model_dir("gpt_oss")

    def build(**switches: Any) -> Engine:
        config = resolve_engine_config(
            model_dir, device="cuda", page_size=PAGE, num_pages=NUM_PAGES, **switches
        )
        return Engine(config, TPGroup(), StreamSet(DEVICE))

    off = {"cuda_graph": False, "piecewise_cuda_graph": False}
    return {
        "float32": build(attention_backend="torch", dtype="float32", **off),
        "torch": build(attention_backend="torch", **off),
        "flashinfer": build(attention_backend="flashinfer", **off),
        "graphs": build(
            attention_backend="flashinfer",
            cuda_graph=True,
            piecewise_cuda_graph=True,
            cuda_graph_max_bs=8,
            piecewise_max_tokens=256,
            fused_decode_max_bs=8,  # asked for, but no group with sinks takes the one-launch decode
        ),
    }


def test_sinks_and_windows_agree_across_backends_and_graphs(
    engines: dict[str, Engine], make_batch: Any, make_tables: Any
) -> None:
    ref, graphs = engines["torch"], engines["graphs"]
    assert [g.window for g in ref.groups] == [None, 32]  # full and window layers in their own groups
    assert all(layer.self_attn.spec.sinks for layer in ref.model.model.layers)
    assert graphs.decode_graphs is not None and graphs.piecewise is not None
    windows = [g.window for g in ref.groups]
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, ref.model_config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    tables = make_tables(len(LENGTHS), -(-max(LENGTHS) // PAGE), NUM_PAGES, seed=3)
    used = {"decode graph": 0, "piecewise": 0}
    for i, spans in enumerate(STEPS):
        n = len(spans)
        batch = make_batch(ids[:n], spans, tables[:n], windows, PAGE, DEVICE)
        used["decode graph"] += graphs.decode_graphs.padded_size(batch) is not None
        used["piecewise"] += not batch.is_decode and graphs.piecewise.padded_size(batch) is not None
        truth, expected = engines["float32"].logits(batch), ref.logits(batch)
        close(engines["flashinfer"].logits(batch), truth, expected, f"step {i}, flashinfer eager")
        close(graphs.logits(batch), truth, expected, f"step {i}, flashinfer with graphs")
        assert all(graphs.attention.fused_decode(gr.group_id) is None for gr in graphs.groups)
    assert used == {"decode graph": 4, "piecewise": 3}


def test_the_sink_epilogue_runs(engines: dict[str, Engine], make_batch: Any, make_tables: Any) -> None:
    """Sinks pushed to -1e4 (no mass on them) change flashinfer's logits: the epilogue is applied."""
    fi = engines["flashinfer"]
    windows = [g.window for g in fi.groups]
    ids = [list(range(3, 3 + n)) for n in LENGTHS]
    tables = make_tables(len(LENGTHS), -(-max(LENGTHS) // PAGE), NUM_PAGES, seed=4)
    batch = make_batch(ids, STEPS[0], tables, windows, PAGE, DEVICE)
    with_sinks = fi.logits(batch).clone()
    sinks = [layer.self_attn.sinks.weight for layer in fi.model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    try:
        for s in sinks:
            s.data.fill_(-1e4)
        plain = fi.logits(batch)
    finally:
        for s, v in zip(sinks, saved):
            s.data.copy_(v)
    assert not torch.equal(plain, with_sinks)
