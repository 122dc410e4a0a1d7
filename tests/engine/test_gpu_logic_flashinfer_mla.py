"""The flashinfer backend's MLA option, checked on CPU: a stand-in `flashinfer.mla` implements the
documented semantics of `BatchMLAPagedAttentionWrapper` (CSR page lists, per-row KV lengths, the
bottom-right causal mask, kv_c and k_pe as separate caches, graph-mode fixed buffers) in plain torch.
If the backend's page lists, lengths, write slots and padding rows are right, it matches the torch
backend's latent attention exactly; the real kernels run only in tests/gpu."""

from __future__ import annotations

import copy
import importlib
import sys
import types
from typing import Any

import pytest
import torch

from tandem.engine.attention.base import LayerSpec
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.kv_pool import KVGroupSpec, KVPool

from .test_gpu_logic_flashinfer_plan import (
    NUM_PAGES,
    PAGE,
    STEPS,
    FakeDecode,
    FakePrefill,
    batch_for,
    fake_append,
)

HEADS, LATENT, ROPE, SCALE = 4, 16, 8, 0.3


class FakeMLA:
    def __init__(
        self, workspace: torch.Tensor, use_cuda_graph: bool = False, backend: str = "auto", **bufs: Any
    ):
        assert workspace.dtype == torch.uint8 and backend == "auto"
        self.graph, self.bufs = use_cuda_graph, bufs

    def plan(
        self,
        qo: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        kv_lens: torch.Tensor,
        heads: int,
        ckv: int,
        kpe: int,
        page: int,
        causal: bool,
        scale: float,
        *dtypes: Any,
    ) -> None:
        assert (heads, ckv, kpe, page, causal, scale) == (HEADS, LATENT, ROPE, PAGE, True, SCALE)
        assert qo.device.type == indptr.device.type == kv_lens.device.type == "cpu", "host metadata"
        assert qo.dtype == indptr.dtype == indices.dtype == kv_lens.dtype == torch.int32
        assert int(indptr[-1]) == indices.shape[0]
        pages = torch.diff(indptr)
        assert bool(((pages - 1) * page < kv_lens).all() and (kv_lens <= pages * page).all())
        if self.graph:  # copy into the fixed buffers, then read only those
            b = self.bufs
            assert b["qo_indptr"].shape == qo.shape and b["kv_len_arr"].shape == kv_lens.shape
            b["qo_indptr"].copy_(qo), b["kv_indptr"].copy_(indptr), b["kv_len_arr"].copy_(kv_lens)
            b["kv_indices"][: indices.shape[0]].copy_(indices)
            qo, indptr, indices, kv_lens = b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_len_arr"]
        self.qo, self.indptr, self.indices, self.kv_lens = qo, indptr, indices, kv_lens

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert ckv.dim() == kpe.dim() == 3 and ckv.shape[1] == PAGE
        result = torch.empty_like(q_nope) if out is None else out
        for b in range(self.kv_lens.shape[0]):
            pages = self.indices[int(self.indptr[b]) : int(self.indptr[b + 1])].long()
            n = int(self.kv_lens[b])
            c, r = ckv[pages].flatten(0, 1)[:n], kpe[pages].flatten(0, 1)[:n]
            lo, hi = int(self.qo[b]), int(self.qo[b + 1])
            scores = (q_nope[lo:hi] @ c.T.unsqueeze(0) + q_pe[lo:hi] @ r.T.unsqueeze(0)) * SCALE  # [q, H, n]
            q_pos = n - (hi - lo) + torch.arange(hi - lo)[:, None, None]
            scores = scores.masked_fill(torch.arange(n)[None, None, :] > q_pos, float("-inf"))
            result[lo:hi] = scores.softmax(-1) @ c
        return result


@pytest.fixture
def backend_cls(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = FakePrefill  # type: ignore[attr-defined]
    fake.BatchDecodeWithPagedKVCacheWrapper = FakeDecode  # type: ignore[attr-defined]
    fake.append_paged_kv_cache = fake_append  # type: ignore[attr-defined]
    fake.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLA)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    event = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda: event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    names = ["tandem.engine.attention.flashinfer_backend", "tandem.engine.attention.flashinfer_mla"]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(names[1])
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    return module.flashinfer_backend


@pytest.mark.parametrize("step", list(STEPS))
def test_mla_plans_match_the_torch_reference(backend_cls: Any, step: str) -> None:
    spans = STEPS[step]
    groups = [KVGroupSpec(0, (0, 1), None, NUM_PAGES)]
    specs = [LayerSpec(i, HEADS, 1, LATENT + ROPE, SCALE, None, None, latent_v=LATENT) for i in (0, 1)]
    pool = KVPool(
        groups, PAGE, 1, LATENT + ROPE, dtype=torch.float32, device=torch.device("cpu"), v_head_dim=0
    )
    for layer in (0, 1):
        pool.k[layer].normal_()
    batch = batch_for(spans, [None], seed=len(step))
    t = batch.num_tokens
    q, k = torch.randn(t, HEADS, LATENT + ROPE), torch.randn(t, 1, LATENT + ROPE)
    v = k[..., :0]
    ref_pool = copy.deepcopy(pool)
    ref = TorchAttentionBackend(groups, PAGE, torch.device("cpu"))
    ref.plan(batch)
    expected = [ref.forward(s, q, k, v, ref_pool) for s in specs]
    fi = backend_cls(groups, PAGE, torch.device("cpu"), layers=specs, dtype=torch.float32, workspace_mb=1)
    assert type(fi).__name__ == "FlashInferMLABackend"
    fi.plan(batch)
    for s, exp in zip(specs, expected):
        torch.testing.assert_close(fi.forward(s, q, k, v, pool), exp, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(pool.k[i], ref_pool.k[i]) for i in (0, 1))
    if batch.is_decode:  # the same rows padded into a graph-sized batch
        fi.init_decode_graphs([1, 2, 4, 8], max_pages_per_row=NUM_PAGES, fused_sizes=[])
        before = [pool.k[i].clone() for i in (0, 1)]
        fi.plan_decode_graph(batch, 8)
        pad = lambda x: torch.cat([x, torch.zeros(8 - x.shape[0], *x.shape[1:])])  # noqa: E731
        for layer, (s, exp) in enumerate(zip(specs, expected)):
            got = fi.forward(s, pad(q), pad(k), pad(k)[..., :0], pool)
            torch.testing.assert_close(got[: len(spans)], exp, rtol=1e-5, atol=1e-5)
            changed = set((pool.k[layer] != before[layer]).any(-1).any(-1).nonzero().flatten().tolist())
            assert changed <= set(range(NUM_PAGES * PAGE, (NUM_PAGES + 1) * PAGE)), "padding wrote live KV"
        fi.plan_decode_graph(None, 4)  # a capture's all-padding plan
        out = fi.forward(
            specs[0], torch.randn(4, HEADS, LATENT + ROPE), torch.randn(4, 1, LATENT + ROPE), v[:4], pool
        )
        assert out.shape == (4, HEADS * LATENT) and bool(out.isfinite().all())


def test_q_k_v_layers_keep_the_paged_backend(backend_cls: Any) -> None:
    groups = [KVGroupSpec(0, (0,), None, NUM_PAGES)]
    fi = backend_cls(groups, PAGE, torch.device("cpu"), layers=[LayerSpec(0, 4, 2, 8, 0.3, None, None)],
                     dtype=torch.float32, workspace_mb=1)  # fmt: skip
    assert type(fi).__name__ == "FlashInferBackend"
