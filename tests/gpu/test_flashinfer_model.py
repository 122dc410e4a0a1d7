"""Whole-model logits with flashinfer attention and fused norm/rope kernels (eager, and through
decode and piecewise CUDA graphs) against the torch attention backend and torch ops, for bf16 models
of real shapes, over prefill, extend over a cached prefix, and decode steps with sliding-window
eviction."""

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
PAGE = 16
NUM_PAGES = 96
LENGTHS = [90, 124, 13, 67]  # each row's final length
# Row spans per step: a prefill, an extend over the cached prefix, decode steps (one with fewer rows, so
# the decode graph pads, and one of a single row, whose graph runs its GEMMs as the Triton GEMV), then
# another mixed extend.
STEPS: list[list[tuple[int, int]]] = [
    [(0, 37), (0, 100), (0, 5), (0, 64)],
    [(37, 50), (100, 120), (5, 9), (64, 65)],
    [(50, 51), (120, 121), (9, 10), (65, 66)],
    [(51, 52), (121, 122), (10, 11), (66, 67)],
    [(52, 53), (122, 123), (11, 12)],
    [(53, 54)],
    [(54, 90), (123, 124), (12, 13)],
]


@pytest.fixture(
    scope="module", params=["qwen3", "gemma3", "llama", pytest.param("gemma2", marks=pytest.mark.slow)]
)
def engines(request: pytest.FixtureRequest, gpu_model_dir: Callable[[str], Path]) -> dict[str, Engine]:
    model_dir = gpu_model_dir(request.param)

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
        # Decode graphs of up to 8 rows run the one-launch decode (the default) in full-attention layers...
        "graphs": build(
            attention_backend="flashinfer",
            cuda_graph=True,
            piecewise_cuda_graph=True,
            cuda_graph_max_bs=8,
            piecewise_max_tokens=256,
            fused_decode_max_bs=8,
            pdl_max_bs=8,  # the small graphs' Triton kernels (and any tinygemm) with PDL
            small_gemm_max_bs=8,
        ),
        # ...and flashinfer's decode here.
        "graphs-flashinfer-decode": build(
            attention_backend="flashinfer",
            cuda_graph=True,
            piecewise_cuda_graph=False,
            cuda_graph_max_bs=8,
            fused_decode_max_bs=0,
        ),
    }


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """RMS error over RMS of the truth: steadier than the max, which one outlier logit moves."""
    return float((got - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt())


def close(got: torch.Tensor, truth: torch.Tensor, bf16_reference: torch.Tensor, what: str) -> None:
    """`got` is as close to the float32 truth as the bf16 torch reference is, within a factor of 2.

    bf16 rounding alone moves these random-weight logits by 3-11% (RMS) of their scale, measured on
    CPU too, and any two bf16 paths that round differently (fused norms, flashinfer's softmax) land
    within 0.7-1.5x of each other there; a wrong page or stale KV errs by the logits' whole scale.
    """
    noise = max(relative_error(bf16_reference, truth), 0.01)
    err = relative_error(got, truth)
    assert err <= 2 * noise, f"{what}: RMS logit error {err:.3f} of scale, bf16 reference {noise:.3f}"
    # A row's argmax may differ only where the truth has a near-tie: the truth's logit at `got`'s
    # choice within the bf16 reference's error scale of its best (a handful of rows in a batch).
    tie = 2 * noise * float(truth.pow(2).mean().sqrt())
    picked = truth.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    agree = float((truth.max(-1).values - picked <= tie).float().mean())
    assert agree >= 0.75, f"{what}: argmax agrees (up to near-ties) on only {agree:.0%} of rows"


def test_logits_agree_across_backends_and_graphs(
    engines: dict[str, Engine], make_batch: Any, make_tables: Any
) -> None:
    ref = engines["torch"]
    windows = [g.window for g in ref.groups]
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, ref.model_config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    tables = make_tables(len(LENGTHS), -(-max(LENGTHS) // PAGE), NUM_PAGES, seed=3)
    graphs = engines["graphs"]
    assert graphs.decode_graphs is not None and graphs.piecewise is not None
    # The one-row graph's GEMMs are the Triton GEMV's (gemv_max_bs defaults to 1), the others' are not.
    plans = graphs.decode_graphs.plans
    assert plans[1].gemv and not any(plans[bs].gemv for bs in plans if bs > 1)
    assert all(layer.mlp.down_proj.gemv_fits for layer in graphs.model.model.layers)
    # The reference runs torch norms and rope too; the flashinfer engines run the fused kernels.
    assert not ref.config.fused_kernels
    assert engines["flashinfer"].config.fused_kernels and graphs.config.fused_kernels
    # Every layer runs its rope (after the q/k norms, for Qwen3 and Gemma 3) as one Triton launch there,
    # which also stores K/V wherever the backend hands it the slots: eager batches and decode graphs.
    for name in ("flashinfer", "graphs"):
        fused_qk = {layer.self_attn.fused_qk for layer in engines[name].model.model.layers}
        assert fused_qk == {True}, name
    used = {"decode graph": 0, "piecewise": 0, "one-launch decode": 0}
    unfused = engines["graphs-flashinfer-decode"]
    # The one-launch decode serves the KV groups without a window or soft-cap: Gemma 3's global layers,
    # every layer of Qwen3 and Llama, none of Gemma 2's (soft-capped).
    served = [
        g.group_id for g in graphs.groups if g.window is None and graphs.model_config.attn_softcap is None
    ]
    for i, spans in enumerate(STEPS):
        n = len(spans)
        batch = make_batch(ids[:n], spans, tables[:n], windows, PAGE, DEVICE)
        used["decode graph"] += graphs.decode_graphs.padded_size(batch) is not None
        used["piecewise"] += not batch.is_decode and graphs.piecewise.padded_size(batch) is not None
        truth, expected = engines["float32"].logits(batch), ref.logits(batch)
        close(engines["flashinfer"].logits(batch), truth, expected, f"step {i}, flashinfer eager")
        close(graphs.logits(batch), truth, expected, f"step {i}, flashinfer with graphs")
        fused = [graphs.attention.fused_decode(gid) is not None for gid in served]
        if graphs.decode_graphs.padded_size(batch) is not None:
            assert all(fused), f"step {i}: a decode graph of {batch.batch_size} rows took flashinfer's decode"
            used["one-launch decode"] += bool(served)
        else:
            assert not any(fused), f"step {i}: the one-launch decode outside a decode graph"
        close(unfused.logits(batch), truth, expected, f"step {i}, flashinfer decode in graphs")
        # The last plan was the graph engine's: a decode graph's fixed slots, else the batch's own.
        slots = graphs.attention.new_kv_slots(0)
        assert slots is not None and slots.shape[0] >= batch.num_tokens
        if graphs.decode_graphs.padded_size(batch) is None:
            assert torch.equal(slots.long(), batch.groups[0].out_cache_loc.long())
        else:
            assert torch.equal(slots[: batch.batch_size].long(), batch.groups[0].out_cache_loc.long())
    assert used == {"decode graph": 4, "piecewise": 3, "one-launch decode": 4 if served else 0}
