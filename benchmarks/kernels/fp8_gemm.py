"""FP8 GEMMs of the Llama-3.1-8B linears on their own, in CUDA graphs, against bf16 (GPU only).

Per layer shape and row count, µs per call and the share of the copy bandwidth its weight bytes reach:
- `bf16`: F.linear on the bf16 weight (cuBLAS), the baseline;
- `w8a8_torch`: per-token activation scales in torch ops, then `torch._scaled_mm`;
- `w8a8`: the one-launch quantizer (engine/quant/triton_fp8.py), then `torch._scaled_mm` (the engine's
  `ScaledMatMul`);
- `block`: flashinfer's `fp8_blockscale_gemm_sm90` over 128 x 128 block scales (bf16 input, quantized
  inside), and `block_channel` the same kernel over unit blocks with per-channel scales multiplied into
  its output (the engine's `BlockScaledMatMul` for block-scaled checkpoints and for per-channel FP8).
Each variant's largest error against x times the dequantized weight, relative to the output's largest
magnitude, is recorded as `<variant>_err`. Weights are cycled over enough copies that L2 serves none.

    python benchmarks/kernels/fp8_gemm.py --out-dir DIR
    python benchmarks/kernels/fp8_gemm.py --out-dir DIR --rows 256,2048,8192   # prefill-sized
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.benchmarks.common import graph_us, measure_ceilings, print_table, write_result
from tandem.engine.quant.fp8_format import FP8, FP8_MAX, quantize_blocks, quantize_per_channel
from tandem.engine.quant.triton_fp8 import quantize_per_token

BF16 = torch.bfloat16
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 8, 16, 64, 256)


def _torch_w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x2 = x.float()
    xs = (x2.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s, out_dtype=BF16)


def _w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_per_token(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s, out_dtype=BF16)


def _fi_block(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    return fp8_blockscale_gemm_sm90(x, w, None, s)  # type: ignore[no-any-return]


@functools.cache
def _unit_blocks(n: int, k: int) -> torch.Tensor:
    return torch.ones(n // 128, k // 128, device="cuda")


def _fi_channel(x: torch.Tensor, w: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    out = fp8_blockscale_gemm_sm90(x, w, None, _unit_blocks(*w.shape))
    return out.mul_(channel)  # type: ignore[no-any-return]


def _variants() -> dict[str, tuple[str, Callable[..., torch.Tensor]]]:
    """name -> (which weight set it reads: bf16, channel, block or channel_rows; the call)."""
    return {
        "bf16": ("bf16", lambda x, w, s: F.linear(x, w)),
        "w8a8_torch": ("channel", _torch_w8a8),
        "w8a8": ("channel", _w8a8),
        "block": ("block", _fi_block),
        "block_channel": ("channel_rows", _fi_channel),
    }


def _cycled(
    call: Callable[..., torch.Tensor], x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], i: int
) -> torch.Tensor:
    return call(x, *pairs[i % len(pairs)])


def layer_rows(
    name: str, n: int, k: int, bandwidth: float, counts: tuple[int, ...] = ROWS
) -> list[dict[str, Any]]:
    bf16_bytes = n * k * 2
    copies = max(2, -(-200_000_000 // (n * k)))
    weights = [torch.randn(n, k, dtype=BF16, device="cuda") * 0.02 for _ in range(copies)]
    channel = [quantize_per_channel(w) for w in weights]
    sets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {
        "bf16": [(w, w) for w in weights],
        "channel": [(q, s.reshape(1, -1).float().contiguous()) for q, s in channel],
        "block": [quantize_blocks(w, (128, 128)) for w in weights],
        "channel_rows": [(q, s.float()) for q, s in channel],
    }
    per_channel = channel[0][0].float() * channel[0][1].float().reshape(-1, 1)
    reference = {
        "channel": per_channel,
        "channel_rows": per_channel,
        "block": sets["block"][0][0].float()
        * sets["block"][0][1].repeat_interleave(128, 0).repeat_interleave(128, 1),
    }
    table = []
    for rows in counts:
        x = torch.randn(rows, k, dtype=BF16, device="cuda")
        row: dict[str, Any] = {"layer": name, "n": n, "k": k, "rows": rows}
        for variant, (kind, call) in _variants().items():
            pairs = sets[kind]
            try:
                got = call(x, *pairs[0]).float()
                if kind != "bf16":
                    want = x.float() @ reference[kind].t()
                    row[f"{variant}_err"] = round(float((got - want).abs().max() / want.abs().max()), 4)
                us = graph_us(functools.partial(_cycled, call, x, pairs), 2 * len(pairs))
                row[variant] = round(us, 2)
                weight_bytes = bf16_bytes if kind == "bf16" else bf16_bytes // 2
                row[f"{variant}_pct_bw"] = round(100 * weight_bytes / bandwidth / (us * 1e-6), 1)
            except Exception as exc:  # a kernel this build lacks or a shape it refuses
                row[variant] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
        table.append(row)
        print(row, flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (tokens) to time")
    args = parser.parse_args()
    counts = tuple(int(r) for r in args.rows.split(","))
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_bandwidth_GBps"] * 1e9
    rows = [r for name, (n, k) in LAYERS.items() for r in layer_rows(name, n, k, bandwidth, counts)]
    config = {"layers": LAYERS, "rows": counts}
    payload = {"config": config, "ceilings": ceilings, "rows": rows}
    write_result("fp8-gemm-kernels", payload, device=device, out_dir=args.out_dir)
    columns = ["bf16", "w8a8_torch", "w8a8", "block", "block_channel"]
    print_table(rows, ["layer", "rows", *columns])


if __name__ == "__main__":
    main()
