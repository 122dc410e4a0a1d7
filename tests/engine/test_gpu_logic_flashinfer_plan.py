"""The GPU path, checked on CPU: what FlashInferBackend plans, checked against the torch reference.

A stand-in `flashinfer` module implements the documented semantics of the two paged wrappers (CSR page
lists, last-page lengths, bottom-right causal masks, inclusive `window_left`, soft-capping, graph-mode
fixed buffers) in plain torch. If the backend's page lists, kv_start handling, padding rows and write
slots are right, it matches the torch backend exactly, and never reads a poisoned slot.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import types
from typing import Any

import pytest
import torch

from tandem.engine.attention.base import LayerSpec
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool

PAGE, NUM_PAGES, POISON = 4, 80, 1000.0


class _Paged:
    """Plain-torch paged attention with flashinfer's conventions."""

    def __init__(
        self, workspace: torch.Tensor, layout: str, use_cuda_graph: bool = False, **buffers: Any
    ) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.buffers = buffers

    def _keep(
        self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, kw: dict[str, Any]
    ) -> None:
        assert indptr.device.type == "cpu" and last.device.type == "cpu", "host metadata avoids syncs"
        assert indptr.dtype == last.dtype == indices.dtype == torch.int32
        assert int(indptr[-1]) == indices.shape[0] and bool((last >= 1).all())
        if self.graph:  # like flashinfer: copy into the fixed buffers, then read only those
            ind, ptr, lst = (
                self.buffers[f"paged_kv_{n}_buffer"] for n in ("indices", "indptr", "last_page_len")
            )
            assert ptr.shape[0] == indptr.shape[0] and indices.shape[0] <= ind.shape[0]
            ptr.copy_(indptr), lst.copy_(last), ind[: indices.shape[0]].copy_(indices)
            indptr, indices, last = ptr, ind, lst
        self.indptr, self.indices, self.last = indptr, indices, last
        self.window_left, self.scale, self.cap = kw["window_left"], kw["sm_scale"], kw["logits_soft_cap"]

    def _attend(
        self,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        qo: list[int],
        out: torch.Tensor | None,
        return_lse: bool = False,
    ) -> Any:
        """The output; with `return_lse`, (output, lse [T, H] float32 in base 2, as flashinfer's)."""
        k_cache, v_cache = kv
        page_size = k_cache.shape[1]
        result = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
        for b in range(len(qo) - 1):
            pages = self.indices[int(self.indptr[b]) : int(self.indptr[b + 1])].long()
            n = (pages.shape[0] - 1) * page_size + int(self.last[b])
            k = k_cache[pages].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            v = v_cache[pages].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            qb = q[qo[b] : qo[b + 1]]
            q_pos = n - qb.shape[0] + torch.arange(qb.shape[0])[:, None]
            key = torch.arange(n)[None, :]
            visible = key <= q_pos
            if self.window_left >= 0:
                visible &= key >= q_pos - self.window_left
            scores = torch.einsum("qhd,khd->hqk", qb.float(), k.float()) * self.scale
            if self.cap > 0:
                scores = self.cap * torch.tanh(scores / self.cap)
            masked = scores.masked_fill(~visible, float("-inf"))
            probs = masked.softmax(-1)
            result[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
            lse[qo[b] : qo[b + 1]] = (torch.logsumexp(masked, -1) / math.log(2)).T
        return (result, lse) if return_lse else result


class FakePrefill(_Paged):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        h: int,
        hkv: int,
        d: int,
        ps: int,
        **kw: Any,
    ) -> None:
        assert kw["causal"] is True and qo_indptr.device.type == "cpu"
        self._keep(indptr, indices, last, kw)
        self.qo = qo_indptr.tolist()

    def run(
        self,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> Any:
        return self._attend(q, kv, self.qo, out, return_lse)


class FakeDecode(_Paged):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        h: int,
        hkv: int,
        d: int,
        ps: int,
        **kw: Any,
    ) -> None:
        self._keep(indptr, indices, last, kw)

    def run(
        self,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> Any:
        assert q.shape[0] == self.last.shape[0], "one query per planned row"
        return self._attend(q, kv, list(range(q.shape[0] + 1)), out, return_lse)


def fake_append(
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    indices: torch.Tensor,
    indptr: torch.Tensor,
    last: torch.Tensor,
) -> None:
    """flashinfer.append_paged_kv_cache as documented: token i of row rows[i] at position positions[i]
    of that row's listed KV goes to page indices[indptr[row] + pos // page_size], offset pos % page_size."""
    assert rows.dtype == positions.dtype == indices.dtype == indptr.dtype == last.dtype == torch.int32
    assert rows.shape[0] == positions.shape[0] == k.shape[0] == v.shape[0]
    assert indptr.shape[0] == last.shape[0] + 1
    k_cache, v_cache = kv
    page_size = k_cache.shape[1]
    for i, (b, pos) in enumerate(zip(rows.tolist(), positions.tolist())):
        listed = (int(indptr[b + 1]) - int(indptr[b]) - 1) * page_size + int(last[b])
        assert 0 <= pos < listed, "appends must land inside the row's listed KV"
        page = int(indices[int(indptr[b]) + pos // page_size])
        k_cache[page, pos % page_size] = k[i]
        v_cache[page, pos % page_size] = v[i]


@pytest.fixture
def backend_cls(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = FakePrefill  # type: ignore[attr-defined]
    fake.BatchDecodeWithPagedKVCacheWrapper = FakeDecode  # type: ignore[attr-defined]
    fake.append_paged_kv_cache = fake_append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    event = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda: event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA host allocator here
    name = "tandem.engine.attention.flashinfer_backend"
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)  # leave no trace for the lazy-import tests
    return module.FlashInferBackend


def batch_for(spans: list[tuple[int, int]], windows: list[int | None], seed: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    width = -(-max(e for _, e in spans) // PAGE)
    tables = (
        (torch.randperm(NUM_PAGES - 1, generator=g)[: len(spans) * width] + 1).view(len(spans), width).int()
    )
    pos = torch.cat([torch.arange(s, e) for s, e in spans])
    row = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(spans)])
    loc = tables[row, pos // PAGE].long() * PAGE + pos % PAGE
    groups = []
    for w in windows:
        keep = [0 if w is None else max(0, s - w + 1) // PAGE * PAGE for s, _ in spans]
        table = tables.clone()
        for b, k in enumerate(keep):
            table[b, : k // PAGE] = 0  # stale entries point at the poisoned page 0
        start = torch.tensor(keep, dtype=torch.int32)
        groups.append(AttentionGroupBatch(table, start, loc, start, table))
    seq = torch.tensor([e for _, e in spans], dtype=torch.int32)
    ext = torch.tensor([e - s for s, e in spans], dtype=torch.int32)
    zeros = torch.zeros(len(spans))
    sampling = SamplingBatch(
        zeros, zeros, zeros.long(), zeros, zeros.long(), zeros.long(), zeros, zeros, zeros
    )
    return ForwardBatch(pos, pos, seq, ext, seq, ext, tuple(groups), sampling, bool((ext == 1).all()))


STEPS = {
    "prefill": [(0, 9), (0, 30), (0, 2)],
    "extend": [(12, 20), (20, 30), (3, 9)],
    "mixed": [(29, 30), (12, 20), (3, 4)],
    "decode": [(29, 30), (12, 13), (3, 4), (21, 22)],
}


@pytest.mark.parametrize(("softcap", "sinks"), [(None, False), (30.0, False), (None, True)])
@pytest.mark.parametrize("step", list(STEPS))
def test_planned_pages_match_the_reference(
    backend_cls: Any, step: str, softcap: float | None, sinks: bool
) -> None:
    """With `sinks` (gpt-oss), flashinfer's output rescaled by sigmoid(lse - sink), the lse in base 2, is
    the torch backend's softmax over the keys plus the sink: in eager batches and padded decode graphs."""
    spans, windows = STEPS[step], [None, 8]
    groups = [KVGroupSpec(i, (i,), w, NUM_PAGES) for i, w in enumerate(windows)]
    specs = [LayerSpec(i, 4, 2, 8, 0.3, w, softcap, sinks=sinks) for i, w in enumerate(windows)]
    sink = torch.tensor([0.5, -1.0, 2.0, 1.5]) if sinks else None
    pool = KVPool(groups, PAGE, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    for layer in (0, 1):
        pool.k[layer].normal_(), pool.v[layer].normal_()
        pool.v[layer][:PAGE] = POISON
    batch = batch_for(spans, windows, seed=len(step))
    for b, (start, _) in enumerate(spans):  # the key just outside each row's window
        if start - 8 >= 0:
            pool.v[1][int(batch.groups[1].page_table[b, (start - 8) // PAGE]) * PAGE + (start - 8) % PAGE] = (
                POISON
            )
    t = batch.num_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    # The torch backend stores through out_cache_loc into its own copy of the pool; flashinfer's
    # append must write exactly the same slots of this one.
    ref_pool = copy.deepcopy(pool)
    ref = TorchAttentionBackend(groups, PAGE, torch.device("cpu"))
    ref.plan(batch)
    expected = [ref.forward(s, q, k, v, ref_pool, sinks=sink) for s in specs]
    if sinks:  # the sinks matter
        plain = TorchAttentionBackend(groups, PAGE, torch.device("cpu"))
        plain.plan(batch)
        unsunk = plain.forward(specs[0], q, k, v, copy.deepcopy(pool))
        assert not torch.allclose(unsunk, expected[0], atol=1e-3)
    fi = backend_cls(groups, PAGE, torch.device("cpu"), layers=specs, dtype=torch.float32, workspace_mb=1)
    assert not any(kernel.one_launch for kernel in fi.kernels.values()) or not sinks
    fi.plan(batch)
    for s, exp in zip(specs, expected):
        got = fi.forward(s, q, k, v, pool, sinks=sink)
        assert float(got.abs().max()) < POISON / 10
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    for layer in (0, 1):
        assert torch.equal(pool.k[layer], ref_pool.k[layer]) and torch.equal(pool.v[layer], ref_pool.v[layer])
    if batch.is_decode:  # the same rows padded into a graph-sized batch
        fi.init_decode_graphs([1, 2, 4, 8], max_pages_per_row=NUM_PAGES, fused_sizes=[])
        before = [pool.k[i].clone() for i in (0, 1)]
        fi.plan_decode_graph(batch, 8)
        pad = lambda x: torch.cat([x, torch.zeros(8 - x.shape[0], *x.shape[1:])])  # noqa: E731
        for layer, (s, exp) in enumerate(zip(specs, expected)):
            got = fi.forward(s, pad(q), pad(k), pad(v), pool, sinks=sink)
            torch.testing.assert_close(got[: len(spans)], exp, rtol=1e-4, atol=1e-4)
            changed = set((pool.k[layer] != before[layer]).any(-1).any(-1).nonzero().flatten().tolist())
            assert changed <= set(range(NUM_PAGES * PAGE, (NUM_PAGES + 1) * PAGE)), (
                "padding wrote outside the dummy page"
            )


def test_decode_graph_without_wrapper_layers_gets_page_lists_without_a_plan(backend_cls: Any) -> None:
    """A decode graph whose capture ran no layer through a group's wrapper (every layer took the
    one-launch decode) skips flashinfer's plan for that group, and its fixed buffers still get exactly the
    page lists a plan would have copied there; a graph whose layers do run the wrapper is planned."""
    windows = [None, 8]
    groups = [KVGroupSpec(i, (i,), w, NUM_PAGES) for i, w in enumerate(windows)]
    specs = [LayerSpec(i, 4, 2, 8, 0.3, w, None) for i, w in enumerate(windows)]
    batch = batch_for(STEPS["decode"], windows, seed=3)
    fi = backend_cls(groups, PAGE, torch.device("cpu"), layers=specs, dtype=torch.float32, workspace_mb=1)
    fi.init_decode_graphs([1, 2, 4, 8], max_pages_per_row=NUM_PAGES, fused_sizes=[])
    fi.plan_decode_graph(None, 8)  # a capture's plan, with no layer run after it
    planned: list[int] = []
    for gid, bufs in fi._graph.items():
        wrapper = bufs.wrappers[8]
        wrapper.plan = lambda *a, _plan=wrapper.plan, _gid=gid, **k: (planned.append(_gid), _plan(*a, **k))

    def buffers() -> list[torch.Tensor]:
        return [t.clone() for b in fi._graph.values() for t in (b.indptr, b.indices, b.last_page_len)]

    fi.plan_decode_graph(batch, 8)
    assert planned == []
    copied = buffers()
    fi._wrapper_graphs.update((gid, 8) for gid in fi._graph)  # as if the capture had run the wrappers
    fi.plan_decode_graph(batch, 8)
    assert sorted(planned) == [0, 1]
    assert all(torch.equal(a, b) for a, b in zip(copied, buffers()))
