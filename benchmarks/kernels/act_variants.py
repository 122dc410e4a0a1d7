"""kernel_choices.py's `act` part: the MLP's activation and product (silu(gate) * up over the merged gate/up
output) at decode batch sizes, flashinfer's `silu_and_mul` against the Triton kernel of small decode graphs
(engine/layers/triton_act.py) at several block sizes and warp counts."""

from __future__ import annotations

from typing import Any

import torch

from tandem.benchmarks.common import graph_us
from tandem.engine.layers.triton_act import silu_and_mul

CALLS = 32


def act_rows(model: str, inter: int, batches: list[int]) -> list[dict[str, Any]]:
    return [_act_row(model, inter, bs) for bs in batches]


def _act_row(model: str, inter: int, bs: int) -> dict[str, Any]:
    import flashinfer

    g = torch.Generator(device="cuda").manual_seed(bs)
    xs = [torch.randn(bs, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(CALLS)]
    row: dict[str, Any] = {"part": "act", "model": model, "inter": inter, "bs": bs}
    want = flashinfer.activation.silu_and_mul(xs[0], enable_pdl=False)
    row["flashinfer"] = round(
        graph_us(lambda i: flashinfer.activation.silu_and_mul(xs[i], enable_pdl=False), CALLS), 2
    )
    for block, warps in ((512, 4), (1024, 4), (2048, 8), (4096, 8)):
        name = f"triton-b{block}-w{warps}"
        try:
            got = silu_and_mul(xs[0], block=block, num_warps=warps)
            row[f"{name}_err"] = round(float((got.float() - want.float()).abs().max()), 4)
            run = lambda i, b=block, w=warps: silu_and_mul(xs[i], block=b, num_warps=w)  # noqa: E731
            row[name] = round(graph_us(run, CALLS), 2)
        except Exception as exc:  # one variant's failure must not hide the others
            row[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    return row
