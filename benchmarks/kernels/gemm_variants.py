"""Each weight GEMM of a decode step on its own, per library, in CUDA graphs (kernel_choices.py's GEMM
part): cuBLAS and cuBLASLt on the [N, K] weight (what F.linear runs), cuBLAS on a [K, N] copy (the other
operand layout) and flashinfer's small-M tinygemm, each against the copy bandwidth, over enough weight
copies that L2 serves none of them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from tandem.benchmarks.common import graph_us

BF16 = torch.bfloat16


GEMM_LIBS = ("cublas", "cublaslt", "cublas_kn", "tinygemm")


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


def _matmul(x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    return x @ weights[j % len(weights)]


def _fi_mm(backend: str, x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    import flashinfer

    return flashinfer.mm_bf16(x, weights[j % len(weights)].t(), backend=backend)  # type: ignore[no-any-return]
