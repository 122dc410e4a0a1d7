"""Each weight GEMM of a decode step on its own, per library, in CUDA graphs (kernel_choices.py's GEMM
part): cuBLAS and cuBLASLt on the [N, K] weight (what F.linear runs), cuBLAS on a [K, N] copy (the other
operand layout), flashinfer's small-M tinygemm, and the Triton candidate (triton_gemv.py), each against
the copy bandwidth, over enough weight copies that L2 serves none of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tandem.benchmarks.common import graph_us

BF16 = torch.bfloat16


GEMM_LIBS = ("cublas", "cublaslt", "cublas_kn", "tinygemm", "triton")


def gemm_rows(
    shape: dict[str, Any], batches: list[int], bandwidth: float, libs: tuple[str, ...] = GEMM_LIBS
) -> list[dict[str, Any]]:
    """Each weight GEMM per library: cuBLAS or cuBLASLt on the [N, K] weight (what F.linear runs),
    cuBLAS on a [K, N] copy (`x @ w`, the other operand layout), flashinfer's small-M tinygemm."""
    h, i, heads, kvh = shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"]
    layers = {
        "qkv": ((heads + 2 * kvh) * shape["head_dim"], h),
        "o": (h, heads * shape["head_dim"]),
        "gate_up": (2 * i, h),
        "down": (h, i),
        "lm_head": (shape["vocab"], h),
    }
    rows = []
    for name, (n, kdim) in layers.items():
        size = n * kdim * 2
        copies = max(2, -(-160_000_000 // size))
        weights = [torch.randn(n, kdim, dtype=BF16, device="cuda") * 0.02 for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights] if "cublas_kn" in libs else []
        for bs in batches:
            x = torch.randn(bs, kdim, dtype=BF16, device="cuda")
            row: dict[str, Any] = {"part": "gemm", "model": shape["name"], "layer": name, "bs": bs}
            for lib in libs:
                if lib == "triton":
                    row.update(_triton_gemv(x, weights, copies, size, bandwidth))
                    continue
                try:
                    if lib in ("cublas", "cublaslt"):
                        torch.backends.cuda.preferred_blas_library(lib)
                        call = functools.partial(_linear, x, weights)
                    elif lib == "cublas_kn":
                        call = functools.partial(_matmul, x, transposed)
                    else:  # flashinfer's bf16 GEMMs; tinygemm is its small-M kernel
                        call = functools.partial(_fi_mm, lib, x, weights)
                    us = graph_us(call, 2 * copies)
                    row[lib] = round(us, 2)
                    row[f"{lib}_pct_bw"] = round(100 * size / bandwidth / (us * 1e-6), 1)
                except Exception as exc:
                    row[lib] = f"failed: {type(exc).__name__}: {str(exc)[:60]}"
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(row)
    return rows


def _linear(x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    return F.linear(x, weights[j % len(weights)])


def _triton_gemv(
    x: torch.Tensor, weights: list[torch.Tensor], copies: int, size: int, bandwidth: float
) -> dict[str, Any]:
    """The candidate Triton kernel (triton_gemv.py) at its best block config, for M <= 8."""
    if x.shape[0] > 8:
        return {}
    try:
        from tandem.benchmarks.triton_gemv import CONFIGS, gemv

        want = F.linear(x, weights[0]).float()
        err = float((gemv(x, weights[0]).float() - want).abs().max() / want.abs().max())
        timed = {}
        m_pad = 1 << (x.shape[0] - 1).bit_length()
        for bn, bk, warps in CONFIGS:
            if m_pad * bn * bk > 128 * 32 * warps:  # over ~128 float32 products per thread: spills
                continue
            call = functools.partial(_gemv_call, gemv, x, weights, (bn, bk, warps))
            timed[(bn, bk, warps)] = graph_us(call, 2 * copies)
        best = min(timed, key=timed.__getitem__)
        us = timed[best]
        return {
            "triton": round(us, 2),
            "triton_pct_bw": round(100 * size / bandwidth / (us * 1e-6), 1),
            "triton_cfg": "x".join(map(str, best)),
            "triton_rel_err": round(err, 4),
        }
    except Exception as exc:
        return {"triton": f"failed: {type(exc).__name__}: {str(exc)[:80]}"}


def _gemv_call(
    gemv: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    cfg: tuple[int, int, int],
    j: int,
) -> torch.Tensor:
    return gemv(x, weights[j % len(weights)], block_n=cfg[0], block_k=cfg[1], num_warps=cfg[2])


def _matmul(x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    return x @ weights[j % len(weights)]


def _fi_mm(backend: str, x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    import flashinfer

    return flashinfer.mm_bf16(x, weights[j % len(weights)].t(), backend=backend)  # type: ignore[no-any-return]
