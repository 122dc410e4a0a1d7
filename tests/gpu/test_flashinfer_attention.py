"""Flashinfer attention against the torch reference, layer by layer, on poisoned KV pools.

Every slot a correct backend must not read holds a huge value: the stale page that evicted table
entries point at, and in window layers the key just outside each row's window. Prefill, extend over
a cached prefix, mixed batches, decode, and decode through a captured CUDA graph with padding rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.engine.attention import backend_factory
from tandem.engine.attention.base import LayerSpec
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
PAGE = 16
NUM_PAGES = 64
POISON = 100.0

CASES: dict[str, dict[str, Any]] = {
    "d128-full": {"heads": 16, "kv_heads": 8, "head_dim": 128, "windows": [None], "softcap": None},
    "d256-full+window": {"heads": 4, "kv_heads": 1, "head_dim": 256, "windows": [None, 32], "softcap": None},
    "d128-softcap+window": pytest.param(
        {"heads": 8, "kv_heads": 4, "head_dim": 128, "windows": [None, 32], "softcap": 50.0},
        marks=pytest.mark.slow,  # two more kernel variants to compile
    ),
}
STEPS = {
    "prefill": [(0, 37), (0, 100), (0, 5)],
    "extend": [(50, 70), (64, 100), (3, 9)],
    "mixed": [(99, 100), (40, 58), (3, 4)],
    "decode": [(99, 100), (40, 41), (3, 4), (70, 71)],
}


class Setup:
    def __init__(
        self, case: dict[str, Any], spans: list[tuple[int, int]], make_batch: Any, make_tables: Any
    ) -> None:
        h, hkv, d = case["heads"], case["kv_heads"], case["head_dim"]
        self.windows: list[int | None] = case["windows"]
        self.groups = [KVGroupSpec(i, (i,), w, NUM_PAGES) for i, w in enumerate(self.windows)]
        self.specs = [
            LayerSpec(i, h, hkv, d, d**-0.5, w, case["softcap"]) for i, w in enumerate(self.windows)
        ]
        self.pool = KVPool(self.groups, PAGE, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        for layer in range(len(self.windows)):
            self.pool.k[layer].normal_(generator=g)
            self.pool.v[layer].normal_(generator=g)
        width = -(-max(e for _, e in spans) // PAGE)
        tables = make_tables(len(spans), width, NUM_PAGES, seed=1)
        self.batch: ForwardBatch = make_batch(
            [[0] * e for _, e in spans], spans, tables, self.windows, PAGE, DEVICE
        )
        self._poison(spans, tables)
        t = self.batch.num_tokens
        self.q = torch.randn(t, h, d, generator=g, device=DEVICE).to(torch.bfloat16)
        self.k = torch.randn(t, hkv, d, generator=g, device=DEVICE).to(torch.bfloat16)
        self.v = torch.randn(t, hkv, d, generator=g, device=DEVICE).to(torch.bfloat16)

    def _poison(self, spans: list[tuple[int, int]], tables: torch.Tensor) -> None:
        for layer, window in enumerate(self.windows):
            self.pool.v[layer][:PAGE] = POISON  # the stale page of evicted entries
            if window is None:
                continue
            for b, (start, _) in enumerate(spans):
                outside = start - window  # outside the window of every query of this row
                if outside >= 0:
                    page = int(tables[b, outside // PAGE])
                    self.pool.v[layer][page * PAGE + outside % PAGE] = POISON

    def reference(self) -> list[torch.Tensor]:
        ref = TorchAttentionBackend(self.groups, PAGE, DEVICE)
        ref.plan(self.batch)
        return [ref.forward(s, self.q, self.k, self.v, self.pool) for s in self.specs]


def check(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert float(got.abs().max()) < POISON / 10, "a slot the backend must not read leaked into the output"
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
def test_eager_matches_reference(case: dict[str, Any], step: str, make_batch: Any, make_tables: Any) -> None:
    setup = Setup(case, STEPS[step], make_batch, make_tables)
    expected = setup.reference()
    fi = backend_factory("flashinfer")(setup.groups, PAGE, DEVICE, layers=setup.specs, dtype=torch.bfloat16)
    fi.plan(setup.batch)
    for spec, exp in zip(setup.specs, expected):
        out = torch.empty_like(exp)
        got = fi.forward(spec, setup.q, setup.k, setup.v, setup.pool, out=out)
        assert got.data_ptr() == out.data_ptr()
        check(got, exp)


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, torch.zeros(rows - t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)])


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_decode_graph_replay_matches_reference(
    case: dict[str, Any], make_batch: Any, make_tables: Callable[..., torch.Tensor]
) -> None:
    setup = Setup(case, STEPS["decode"], make_batch, make_tables)
    expected = setup.reference()
    before = {layer: setup.pool.k[layer].clone() for layer in range(len(setup.windows))}
    fi = backend_factory("flashinfer")(setup.groups, PAGE, DEVICE, layers=setup.specs, dtype=torch.bfloat16)
    graph_bs, n = 8, setup.batch.batch_size
    fi.init_decode_graphs([1, 2, 4, graph_bs], max_pages_per_row=NUM_PAGES, fused_sizes=[])
    q, k, v = (
        torch.zeros(graph_bs, *t.shape[1:], dtype=t.dtype, device=DEVICE) for t in (setup.q, setup.k, setup.v)
    )
    fi.plan_decode_graph(None, graph_bs)  # capture against all-padding metadata
    outs, graphs = [], []
    for spec in setup.specs:
        fi.forward(spec, q, k, v, setup.pool)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fi.forward(spec, q, k, v, setup.pool))
        graphs.append(graph)
    fi.plan_decode_graph(setup.batch, graph_bs)
    q.copy_(padded(setup.q, graph_bs))
    k.copy_(padded(setup.k, graph_bs))
    v.copy_(padded(setup.v, graph_bs))
    for graph, out, exp in zip(graphs, outs, expected):
        graph.replay()
        check(out[:n], exp)
    # Only the batch's own slots and the dummy page were written.
    for layer, old in before.items():
        changed = (setup.pool.k[layer] != old).any(dim=(1, 2)).nonzero().flatten()
        dummy = setup.pool.dummy_page(setup.pool.layer_group[layer])
        allowed = set(setup.batch.groups[0].out_cache_loc.tolist()) | set(
            range(dummy * PAGE, (dummy + 1) * PAGE)
        )
        assert set(changed.tolist()) <= allowed
