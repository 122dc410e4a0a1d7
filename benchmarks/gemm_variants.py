"""Each weight GEMM of a decode step on its own, per library, in CUDA graphs (kernel_choices.py's GEMM
part): cuBLAS and cuBLASLt on the [N, K] weight (what F.linear runs), cuBLAS on a [K, N] copy (the other
operand layout), flashinfer's small-M tinygemm, and a Triton small-batch candidate (triton_gemv.py),
each against the copy bandwidth, over enough weight copies that L2 serves none of them.
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
    """The Triton candidate (triton_gemv.py) at the block config `pick_config` chooses and at the best
    of the sweep, for M <= 8."""
    try:
        from tandem.benchmarks.triton_gemv import MAX_M, SWEEP, gemv, m_pad, pick_config
    except ImportError as exc:
        return {"triton": f"failed: {exc}"}
    if x.shape[0] > MAX_M:
        return {}
    try:
        (m, k), n = x.shape, weights[0].shape[0]
        picked = pick_config(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
        want = F.linear(x, weights[0]).float()
        got = gemv(x, weights[0], config=picked).float()
        err = float((got - want).abs().max() / want.abs().max())
        timed = {}
        for cfg in {picked, *(c for c in SWEEP if c.fits(m_pad(m)))}:
            call = functools.partial(_gemv_call, gemv, x, weights, cfg)
            timed[cfg] = graph_us(call, 2 * copies)
        best = min(timed, key=timed.__getitem__)

        def pct(us: float) -> float:
            return round(100 * size / bandwidth / (us * 1e-6), 1)

        def name(c: Any) -> str:
            return f"{c.block_n}x{c.block_k}x{c.num_warps}"

        return {
            "triton": round(timed[picked], 2),
            "triton_pct_bw": pct(timed[picked]),
            "triton_cfg": name(picked),
            "triton_best": round(timed[best], 2),
            "triton_best_pct_bw": pct(timed[best]),
            "triton_best_cfg": name(best),
            "triton_rel_err": round(err, 4),
            "triton_sweep": {name(c): round(us, 2) for c, us in sorted(timed.items(), key=lambda t: t[1])},
        }
    except Exception as exc:
        return {"triton": f"failed: {type(exc).__name__}: {str(exc)[:80]}"}


def _gemv_call(
    gemv: Callable[..., torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor], cfg: Any, j: int
) -> torch.Tensor:
    return gemv(x, weights[j % len(weights)], config=cfg)


def _matmul(x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    return x @ weights[j % len(weights)]


def _fi_mm(backend: str, x: torch.Tensor, weights: list[torch.Tensor], j: int) -> torch.Tensor:
    import flashinfer

    return flashinfer.mm_bf16(x, weights[j % len(weights)].t(), backend=backend)  # type: ignore[no-any-return]
