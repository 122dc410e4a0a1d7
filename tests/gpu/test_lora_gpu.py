"""LoRA on the GPU: the batched Triton kernels against a per-row PyTorch reference in bfloat16 (Llama-3.1-8B
layer shapes, ranks 16 and 64, one row to prefill sizes, slots mixed with base rows, with and without PDL),
the GEMV with a delta folded in (one-row decode graphs), and a LoRA model under every graph (decode
graphs with and without the deltas, piecewise graphs with them) giving the eager run's greedy tokens
(near-ties within bf16 rounding excepted; see conftest)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (name, input width, slice widths): Llama-3.1-8B's merged q/k/v, o, gate/up and down at TP 1.
LAYERS = [
    ("qkv", 4096, (4096, 1024, 1024)),
    ("o", 4096, (4096,)),
    ("gate_up", 4096, (14336, 14336)),
    ("down", 14336, (4096,)),
]
BATCHES = [  # (extend lengths, slots per row)
    ([1], [3]),
    ([1] * 8, [0, 1, 2, 3, 4, 5, 6, 7]),
    ([1] * 64, [i % 9 - 1 for i in range(64)]),  # every slot and base rows
    ([300, 1, 1, 57], [2, -1, 5, 2]),
    ([2048], [6]),
]


def _reference(
    x: torch.Tensor,
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    owner: np.ndarray,
    slices: list[tuple[int, int]],
    rank: int,
) -> torch.Tensor:
    want = base.float().clone()
    for t in range(x.shape[0]):
        s = int(owner[t])
        if s < 0:
            continue
        for j, (offset, size) in enumerate(slices):
            shrunk = a[s, j * rank : (j + 1) * rank].float() @ x[t].float()
            want[t, offset : offset + size] += b[s, offset : offset + size].float() @ shrunk
    return want


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("name,k,widths", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_kernels_match_a_per_row_reference(name: str, k: int, widths: tuple[int, ...], rank: int) -> None:
    from tandem.engine.kernel_plan import KernelPlan
    from tandem.engine.lora.batch import LoraBatchBuffers
    from tandem.engine.lora.delta import LoraContext, LoraDelta
    from tandem.engine.lora.layout import LinearLayout, LoraSlice
    from tandem.engine.lora.triton_lora import TritonLoraOps

    device = torch.device("cuda")
    slots = 8
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    pieces = tuple(LoraSlice(f"p{i}", o, w, 0) for i, (o, w) in enumerate(zip(offsets, widths)))
    out_features = sum(widths)
    layout = LinearLayout(0, len(widths) == 1, pieces, k, 0, out_features, rank, 0, 0)
    g = torch.Generator(device=device).manual_seed(k + rank)
    a = (torch.randn(slots, layout.a_rows, k, generator=g, device=device) / k**0.5).bfloat16()
    b = (torch.randn(slots, out_features, rank, generator=g, device=device) / rank**0.5).bfloat16()
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for lens, row_slots in BATCHES:
        tokens = sum(lens)
        x = torch.randn(tokens, k, generator=g, device=device).bfloat16()
        base = torch.randn(tokens, out_features, generator=g, device=device).bfloat16()
        buffers = LoraBatchBuffers(4096, slots, device)
        buffers.write(np.array(row_slots, dtype=np.int32), np.array(lens, dtype=np.int32))
        owner = np.repeat(row_slots, lens)
        want = _reference(x, base, a, b, owner, list(zip(offsets, widths)), rank)
        for pdl in (False, True) if hopper and tokens <= 8 else (False,):
            got = base.clone()
            LoraDelta(a, b, layout, LoraContext(buffers), TritonLoraOps()).add(
                x, got, KernelPlan(lora=True, pdl=pdl)
            )
            torch.cuda.synchronize()
            rows = torch.from_numpy(owner >= 0).to(device)
            assert torch.equal(got[~rows], base[~rows]), "a base row changed"
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            # bf16 output rounding plus the shrink's bf16 hand-off to the expand.
            assert err < 2e-2, (name, rank, lens[:3], pdl, err)


@pytest.mark.parametrize("name,k,widths", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_the_gemv_with_the_delta_folded_in_matches_the_reference(
    name: str, k: int, widths: tuple[int, ...]
) -> None:
    """One-row decode graphs fold the expand into the Triton GEMV (engine/layers/low_rank.py): one row of
    an adapter, and three rows with a base row between two adapters, with and without PDL, in a graph."""
    from tandem.engine.kernel_plan import KernelPlan
    from tandem.engine.layers.triton_gemv import gemv, takes_delta
    from tandem.engine.lora.batch import LoraBatchBuffers
    from tandem.engine.lora.delta import LoraContext, LoraDelta
    from tandem.engine.lora.layout import LinearLayout, LoraSlice
    from tandem.engine.lora.triton_lora import TritonLoraOps

    device, slots, rank = torch.device("cuda"), 8, 16
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    pieces = tuple(LoraSlice(f"p{i}", o, w, 0) for i, (o, w) in enumerate(zip(offsets, widths)))
    layout = LinearLayout(0, len(widths) == 1, pieces, k, 0, sum(widths), rank, 0, 0)
    g = torch.Generator(device=device).manual_seed(k)
    w = (torch.randn(sum(widths), k, generator=g, device=device) / k**0.5).bfloat16()
    a = (torch.randn(slots, layout.a_rows, k, generator=g, device=device) / k**0.5).bfloat16()
    b = (torch.randn(slots, sum(widths), rank, generator=g, device=device) / rank**0.5).bfloat16()
    assert takes_delta(w, offsets)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for row_slots in ([3], [5, -1, 0]):
        x = torch.randn(len(row_slots), k, generator=g, device=device).bfloat16()
        buffers = LoraBatchBuffers(16, slots, device)
        buffers.write(np.array(row_slots, dtype=np.int32), np.ones(len(row_slots), dtype=np.int32))
        delta = LoraDelta(a, b, layout, LoraContext(buffers), TritonLoraOps())
        base = gemv(x, w)
        want = _reference(x, base, a, b, np.array(row_slots), list(zip(offsets, widths)), rank)
        for pdl in (False, True) if hopper else (False,):
            plan = KernelPlan(rows=len(row_slots), gemv=True, lora=True, pdl=pdl)
            out: list[torch.Tensor] = []
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.append(gemv(x, w, pdl=pdl, delta=delta.fold(x, plan)))
            graph.replay()
            torch.cuda.synchronize()
            got = out[0]
            base_rows = torch.tensor([s < 0 for s in row_slots], device=device)
            assert torch.equal(got[base_rows], base[base_rows]), "a base row changed"
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, (name, row_slots, pdl, err)


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
BASE: dict[str, Any] = {
    "device": "cuda",
    "num_pages": 512,
    "cuda_graph_max_bs": 16,
    "piecewise_max_tokens": 512,
}
OFF: dict[str, Any] = {"overlap": False, "cuda_graph": False, "piecewise_cuda_graph": False}


@pytest.fixture(scope="module")
def lora_case(
    gpu_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from tandem.engine.tiny.adapters import write_random_adapter

    model_dir = gpu_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-gpu")
    paths = [
        write_random_adapter(root / f"a{i}", model_dir, rank=r, alpha=2 * r, seed=i, dtype=torch.bfloat16)
        for i, r in enumerate((16, 8, 16))
    ]
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(5, 300, (12,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    loras = [
        None if i % 4 == 3 else LoRARequest(f"a{i % 4}", 1 + i % 4, str(paths[i % 4])) for i in range(12)
    ]
    return {"model_dir": model_dir, "prompts": prompts, "loras": loras}


def _run(case: dict[str, Any], **options: Any) -> tuple[list[Any], dict[str, Any]]:
    llm = LLM(str(case["model_dir"]), enable_lora=True, max_loras=2, **{**BASE, **options})
    outs = llm.generate(case["prompts"], GREEDY, lora_request=case["loras"], use_tqdm=False)
    engine = llm.runtime.engine
    info = {
        "stats": llm.stats(),
        "graphs": sorted(engine.decode_graphs.graphs) if engine.decode_graphs else [],
    }
    llm.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return outs, info


@pytest.mark.parametrize("setting", [{}, {"piecewise_cuda_graph": False}, {"chunk_size": 64}], ids=str)
def test_lora_under_cuda_graphs_matches_eager(
    lora_case: dict[str, Any], setting: dict[str, Any], assert_same_greedy: Callable[..., None]
) -> None:
    """Three adapters over two slots and base rows: decode graphs with and without the deltas, piecewise
    graphs with them (base prefill batches over no tiles), slot loads between graph replays."""
    expected, _ = _run(lora_case, **OFF)
    outs, info = _run(lora_case, **setting)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_same_greedy(expected, outs)
    assert (1, True) in info["graphs"] and (1, False) in info["graphs"]
    assert info["stats"]["lora_evictions"] >= 1  # three adapters through two slots
