"""kernel_choices.py's `act` part: the MLP's activation and product (silu(gate) * up over the merged gate/up
output) at decode batch sizes, flashinfer's `silu_and_mul` (what the engine runs) against a candidate Triton
kernel of one program per block of a row, for small decode graphs, where the norms' Triton form already won
(1.6 against 2.5 µs at one row; kernel-choices-decode-fused.json). Not wired into the engine: this part
decides whether it should be."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tandem.benchmarks.common import graph_us

CALLS = 32


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # one rounding, as flashinfer's kernel
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x [T, 2N] (gate then up) -> silu(gate) * up [T, N]."""
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    launch: Any = silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))]
    launch(x, out, x.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=num_warps)
    return out


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
