"""Latent attention on the GPU with flashinfer's MLA kernels (BatchMLAPagedAttentionWrapper; fa3 on
SM90): the backend's attention against the torch reference on the same latent pool, for prefill over a
cached prefix and decode; and DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank 512,
qk_rope_head_dim 64) served with decode and piecewise CUDA graphs giving the torch backend's eager greedy
tokens (near-ties within bf16 rounding excepted, as test_moe_gpu.py allows for routing flips)."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.attention import backend_factory
from tandem.engine.attention.base import LayerSpec
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool

from .test_moe_gpu import assert_moe_greedy_agrees

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
HEADS, LATENT, ROPE, PAGE, PAGES = 16, 512, 64, 16, 64
V2_LITE_ATTENTION: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "kv_lora_rank": LATENT,
    "qk_rope_head_dim": ROPE,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
}


def _batch(spans: list[tuple[int, int]]) -> ForwardBatch:
    g = torch.Generator().manual_seed(0)
    width = -(-max(e for _, e in spans) // PAGE)
    tables = (torch.randperm(PAGES - 1, generator=g)[: len(spans) * width]).view(len(spans), width).int()
    pos = torch.cat([torch.arange(s, e) for s, e in spans])
    row = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(spans)])
    loc = (tables[row, pos // PAGE].long() * PAGE + pos % PAGE).to(DEVICE)
    start = torch.zeros(len(spans), dtype=torch.int32)
    group = AttentionGroupBatch(tables.to(DEVICE), start.to(DEVICE), loc, start, tables)
    seq = torch.tensor([e for _, e in spans], dtype=torch.int32)
    ext = torch.tensor([e - s for s, e in spans], dtype=torch.int32)
    zeros = torch.zeros(len(spans), device=DEVICE)
    sampling = SamplingBatch(
        zeros, zeros, zeros.long(), zeros, zeros.long(), zeros.long(), zeros, zeros, zeros
    )
    return ForwardBatch(pos.to(DEVICE), pos.to(DEVICE), seq.to(DEVICE), ext.to(DEVICE), seq, ext, (group,),
                        sampling, bool((ext == 1).all()))  # fmt: skip


@pytest.mark.parametrize("spans", [[(0, 37), (100, 180), (5, 6)], [(300, 301), (17, 18), (64, 65)]])
def test_flashinfer_mla_matches_the_torch_reference(spans: list[tuple[int, int]]) -> None:
    groups = [KVGroupSpec(0, (0,), None, PAGES)]
    spec = LayerSpec(0, HEADS, 1, LATENT + ROPE, 0.07, None, None, latent_v=LATENT)
    pool = KVPool(groups, PAGE, 1, LATENT + ROPE, dtype=torch.bfloat16, device=DEVICE, v_head_dim=0)
    pool.k[0].normal_()
    batch = _batch(spans)
    t = batch.num_tokens
    q = torch.randn(t, HEADS, LATENT + ROPE, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(t, 1, LATENT + ROPE, device=DEVICE, dtype=torch.bfloat16)
    ref_pool = copy.deepcopy(pool)
    ref = TorchAttentionBackend(groups, PAGE, DEVICE)
    ref.plan(batch)
    want = ref.forward(spec, q, k, k[..., :0], ref_pool).float()
    fi = backend_factory("flashinfer")(groups, PAGE, DEVICE, layers=[spec], dtype=torch.bfloat16)
    assert type(fi).__name__ == "FlashInferMLABackend"
    fi.plan(batch)
    got = fi.forward(spec, q, k, k[..., :0], pool).float()
    assert torch.equal(pool.k[0], ref_pool.k[0])
    assert float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 1e-2


def test_deepseek_under_mla_decode_graphs_matches_the_torch_backend(
    tiny_model_dir: Callable[..., Path], greedy_disagreements: Callable[..., list[str]]
) -> None:
    model_dir = tiny_model_dir("deepseek_v2", **V2_LITE_ATTENTION)
    g = torch.Generator().manual_seed(0)
    batch = [
        torch.randint(3, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 300, (12,), generator=g)
    ]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5)
    base = {"device": "cuda", "num_pages": 512, "chunk_size": 64, "cuda_graph_max_bs": 16}
    outs = {}
    for name, options in {
        "torch": {"attention_backend": "torch", "cuda_graph": False, "piecewise_cuda_graph": False},
        "mla-graphs": {"attention_backend": "flashinfer", "cuda_graph": True, "piecewise_cuda_graph": True},
    }.items():
        llm = LLM(str(model_dir), **base, **options)
        engine = llm.runtime.engine
        assert engine.config.cuda_graph == (name == "mla-graphs")
        assert engine.kv_bytes_per_token == 2 * (LATENT + ROPE) * 2  # two layers, one bf16 latent each
        outs[name] = llm.generate(batch, greedy, use_tqdm=False)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert all(len(o.token_ids) == greedy.max_tokens for o in outs["mla-graphs"])
    assert_moe_greedy_agrees(greedy_disagreements, outs["torch"], outs["mla-graphs"])
