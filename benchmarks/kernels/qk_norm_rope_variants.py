"""The per-head q/k norms and rope of a Qwen3 or Gemma 3 layer (kernel_choices.py's qk_norm_rope part):
flashinfer's three kernels, which the engine runs, against the fused Triton candidate
(engine/layers/qk_norm_rope.py), and with the K/V append as a fourth kernel against the candidate writing the
paged cache itself. Each alone in CUDA graphs, 28 calls per replay (one per Qwen3-0.6B layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.benchmarks.common import graph_us
from tandem.benchmarks.kernels.paged_case import BF16, HEAD_DIM, PAGE, PagedCase


def qk_norm_rope_rows(shape: dict[str, Any], tokens: list[int], gemma: bool) -> list[dict[str, Any]]:
    """Per-head q/k norms and rope: the engine's three flashinfer kernels against the fused Triton
    candidate (engine/layers/qk_norm_rope.py), on the merged q/k/v output of one layer; for head_dim 128 also
    with the K/V append (flashinfer's fourth kernel) against the candidate writing the cache itself."""
    from tandem.engine.config import RopeConfig
    from tandem.engine.layers.fused import FusedKernels
    from tandem.engine.layers.qk_norm_rope import qk_norm_rope
    from tandem.engine.layers.rotary import inverse_frequencies

    heads, kvh, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    kernels = FusedKernels(max_positions=8192)
    rope = RopeConfig(theta=1e6)
    table = kernels.cos_sin_table(rope, inverse_frequencies(rope, d).cuda())
    qw = torch.randn(d, dtype=BF16, device="cuda") * 0.1 + 1
    kw = torch.randn(d, dtype=BF16, device="cuda") * 0.1 + 1
    rows = []
    for t in tokens:
        qkv = torch.randn(t, (heads + 2 * kvh) * d, dtype=BF16, device="cuda")
        case = PagedCase(kvh, t, 512, 1) if d == HEAD_DIM else None
        pos = torch.full((t,), 511, dtype=torch.int64, device="cuda")

        def chain(_: int, qkv: torch.Tensor = qkv, pos: torch.Tensor = pos) -> tuple[torch.Tensor, ...]:
            q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
            q = kernels.rmsnorm(q.view(-1, heads, d), qw, 1e-6, gemma=gemma)
            k = kernels.rmsnorm(k.view(-1, kvh, d), kw, 1e-6, gemma=gemma)
            return (*kernels.rope(pos, q, k, table), v.view(-1, kvh, d))

        def fused(_: int, qkv: torch.Tensor = qkv, pos: torch.Tensor = pos) -> tuple[torch.Tensor, ...]:
            return qk_norm_rope(
                qkv, pos, qw, kw, table, num_heads=heads, num_kv_heads=kvh, eps=1e-6, gemma=gemma
            )

        row: dict[str, Any] = {"part": "qk_norm_rope", "model": shape["name"], "tokens": t}
        row["flashinfer_x3"] = round(graph_us(chain, 28), 2)
        try:
            want, got = chain(0), fused(0)
            row["triton_fused"] = round(graph_us(fused, 28), 2)
            row["max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(want, got))
            if case is not None:
                row.update(_with_append(case, chain, qk_norm_rope, qkv, pos, (qw, kw, table), shape, gemma))
        except Exception as exc:
            row["triton_fused"] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
    return rows


def _with_append(
    case: PagedCase,
    chain: Callable[[int], tuple[torch.Tensor, ...]],
    fused_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    qkv: torch.Tensor,
    pos: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shape: dict[str, Any],
    gemma: bool,
) -> dict[str, Any]:
    """The four-kernel chain (norms, rope, flashinfer's append) against the candidate's cache writes,
    each token at the last position of its row's pages."""
    import flashinfer

    t, kvh = case.bs, shape["kv_heads"]
    batch_idx = torch.arange(t, dtype=torch.int32, device="cuda")
    positions = pos.to(torch.int32)
    first = case.indices[case.indptr[:-1].long() + (case.ctx - 1) // PAGE].long()
    slots = first * PAGE + (case.ctx - 1) % PAGE
    k_cache, v_cache = case.caches[0]
    flat = (k_cache.view(-1, kvh, HEAD_DIM), v_cache.view(-1, kvh, HEAD_DIM))

    def chain4(i: int) -> None:
        _q, k, v = chain(i)
        flashinfer.append_paged_kv_cache(
            k, v, batch_idx, positions, case.caches[0], case.indices, case.indptr, case.last
        )

    def fused4(_: int) -> None:
        qw, kw, table = weights
        fused_fn(
            qkv,
            pos,
            qw,
            kw,
            table,
            num_heads=shape["heads"],
            num_kv_heads=kvh,
            eps=1e-6,
            gemma=gemma,
            kv_cache=(flat[0], flat[1], slots),
        )

    chain4(0)
    want = (flat[0][slots].clone(), flat[1][slots].clone())
    fused4(0)
    diff = max(float((flat[j][slots].float() - want[j].float()).abs().max()) for j in (0, 1))
    return {
        "flashinfer_x4_append": round(graph_us(chain4, 28), 2),
        "triton_fused_append": round(graph_us(fused4, 28), 2),
        "append_max_abs_diff": diff,
    }
