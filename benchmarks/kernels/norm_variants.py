"""kernel_choices.py's `norm` part: the residual add + RMS norm at decode batch sizes, flashinfer's
`fused_add_rmsnorm` (what the engine runs) against the one-program-per-row Triton kernel
(engine/layers/triton_norm.py) at several warp counts. Each call works on its own buffers, cycled in a
CUDA graph, as a step's 64 norms do; each Triton variant records its largest difference from flashinfer."""

from __future__ import annotations

from typing import Any

import torch

from tandem.benchmarks.common import graph_us

CALLS = 64


def norm_rows(model: str, hidden: int, batches: list[int]) -> list[dict[str, Any]]:
    return [_norm_row(model, hidden, bs) for bs in batches]


def _norm_row(model: str, hidden: int, bs: int) -> dict[str, Any]:
    import flashinfer

    from tandem.engine.layers.triton_norm import add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(bs)
    xs = [torch.randn(bs, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(CALLS)]
    rs = [torch.randn_like(x) for x in xs]
    w = torch.rand(hidden, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    row: dict[str, Any] = {"part": "norm", "model": model, "hidden": hidden, "bs": bs}

    def fi(i: int) -> None:
        flashinfer.norm.fused_add_rmsnorm(xs[i], rs[i], w, 1e-6, enable_pdl=False)

    x0, r0 = xs[0].clone(), rs[0].clone()
    fi(0)
    want_x, want_r = xs[0].clone(), rs[0].clone()
    row["flashinfer"] = round(graph_us(fi, CALLS), 2)
    for warps in (4, 8, 16):
        name = f"triton-w{warps}"
        try:
            x, r = x0.clone(), r0.clone()
            add_rmsnorm(x, r, w, 1e-6, gemma=False, num_warps=warps)
            row[f"{name}_err"] = round(float((x.float() - want_x.float()).abs().max()), 4)
            row[f"{name}_residual_same"] = bool(torch.equal(r, want_r))

            def tri(i: int, warps: int = warps) -> None:
                add_rmsnorm(xs[i], rs[i], w, 1e-6, gemma=False, num_warps=warps)

            row[name] = round(graph_us(tri, CALLS), 2)
        except Exception as exc:  # one variant's failure must not hide the others
            row[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    return row
