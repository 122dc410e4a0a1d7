"""The fused MoE experts with MXFP4 weights (W4A16: engine/moe/triton_mxfp4.py) against the same experts
in bf16, at gpt-oss-20b's expert shape (32 experts, top 4, hidden 2880, intermediate 2880, gpt-oss's
top-k-then-softmax routing, biases and clamped SwiGLU, bf16 activations), at 1, 2, 8 and 64 tokens:
the one- and two-token GEMVs (triton_small.py) and the grouped GEMMs (triton_gemm.py).

Both formats compute the same function: the `dense` experts (bf16) are the MXFP4 ones dequantized
(exact), so the dense run is this run's baseline on the same routing. Each (format, tokens) is timed in
a CUDA graph of `--layers` calls (a decode step's MoE layers), each with its own weights, tokens and
router logits, so L2 serves none of one call's weights to the next; PDL at one and two tokens, as the
engine's small decode graphs launch them. `floor_us` is what a call must read or write (the weights of
the distinct experts its tokens chose, at the format's bytes, and their biases; the tokens, the
activations written and read, the rows written) over the copy bandwidth measured in the same run
(common.measure_ceilings); `x_floor` = us / floor_us. Every run is checked against the float32
reference first (`rel_rms`).

    python benchmarks/kernels/moe_mxfp4.py --out /tmp/moe-mxfp4.json
    TRITON_INTERPRET=1 python benchmarks/kernels/moe_mxfp4.py --tiny --out /tmp/x.json   # CPU smoke run

The smoke run takes a tiny shape whose reductions are multiples of 32 but not of 64 (as 2880 is no
power of two) in float16 (the interpreter's bf16 tl.dot is wrong); its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import call_timer, measure_ceilings, print_table, write_record
from tandem.engine.moe.fused import SMALL_MAX_TOKENS, FusedMoE
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.mxfp4 import BLOCK, dequantize, fill_dummy

FORMATS = ("mxfp4", "dense")  # dense: the experts in the activations' dtype, bf16
MXFP4_BYTES = 0.5 + 1 / BLOCK  # a value's packed nibble and its share of a scale byte


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int


GPT_OSS_20B = Shape(32, 4, 2880, 2880)
TINY = Shape(8, 2, 160, 96)  # 5 and 3 blocks of 32


def gpt_oss_spec(shape: Shape) -> MoESpec:
    options: dict[str, Any] = {"scoring": "topk_softmax", "router_bias": True, "expert_bias": True,
                               "activation": "swiglu_clamped", "gpt_oss_layout": True}  # fmt: skip
    return MoESpec(shape.experts, shape.top_k, shape.inter, False, (True,), **options)


def expert_bytes(shape: Shape, fmt: str, elem: int = 2) -> float:
    """One expert's weights (gate, up and down) in `fmt` and its biases (`elem` bytes a value)."""
    per_value = MXFP4_BYTES if fmt == "mxfp4" else elem
    return 3 * shape.hidden * shape.inter * per_value + (2 * shape.inter + shape.hidden) * elem


def call_bytes(shape: Shape, ids: torch.Tensor, fmt: str, elem: int = 2) -> float:
    """What one call must read or write for the routing `ids` [T, k]: every expert a token chose, once,
    the tokens, each pair's activation (written, then read) and the output rows."""
    tokens, pairs = ids.shape[0], ids.numel()
    hit = len(set(ids.flatten().tolist()))
    activations = (tokens * shape.hidden + 2 * pairs * shape.inter + tokens * shape.hidden) * elem
    return hit * expert_bytes(shape, fmt, elem) + activations


@dataclass
class Layer:
    """One MoE layer's experts in both formats: MXFP4 (`w13`/`w2` packed, `s13`/`s2` e8m0 scales) and
    the same values dense in the activations' dtype."""

    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, s13, w2, s2
    dense: tuple[torch.Tensor, torch.Tensor]  # w13 [E, 2I, H], w2 [E, H, I]
    biases: tuple[torch.Tensor, torch.Tensor]  # b13 [E, 2I], b2 [E, H]

    @classmethod
    def draw(cls, shape: Shape, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> Layer:
        e, h, i = shape.experts, shape.hidden, shape.inter
        parts = []
        for rows, k in ((2 * i, h), (h, i)):
            blocks = torch.empty(e, rows, k // 2, dtype=torch.uint8, device=device)
            scales = torch.empty(e, rows, k // BLOCK, dtype=torch.uint8, device=device)
            fill_dummy(blocks, scales=False, generator=g)
            fill_dummy(scales, scales=True, generator=g)
            parts += [blocks, scales]
        w13, s13, w2, s2 = parts
        dense13 = dequantize(w13.view(e, 2 * i, h // BLOCK, BLOCK // 2), s13).to(dtype)
        dense2 = dequantize(w2.view(e, h, i // BLOCK, BLOCK // 2), s2).to(dtype)
        b13 = (torch.randn(e, 2 * i, generator=g, device=device) * 0.1).to(dtype)
        b2 = (torch.randn(e, h, generator=g, device=device) * 0.1).to(dtype)
        return cls((w13, s13, w2, s2), (dense13, dense2), (b13, b2))

    def run(
        self, fused: FusedMoE, fmt: str, x: torch.Tensor, logits: torch.Tensor, pdl: bool
    ) -> torch.Tensor:
        b13, b2 = self.biases
        if fmt == "mxfp4":
            w13, s13, w2, s2 = self.packed
            return fused(x, logits, w13, w2, None, None, pdl, b13, b2, s13, s2)
        return fused(x, logits, *self.dense, None, None, pdl, b13, b2)


def measure(
    shape: Shape,
    layers: list[Layer],
    tokens: int,
    bandwidth_gbps: float,
    device: torch.device,
    dtype: torch.dtype,
) -> list[dict[str, Any]]:
    """Both formats at `tokens` tokens, each layer called once with its own tokens and logits."""
    spec = gpt_oss_spec(shape)
    fused = FusedMoE(spec, ExpertShard.of(spec, 0, 1, expert_parallel=False), shape.hidden)
    g = torch.Generator(device=device).manual_seed(tokens)
    xs = torch.randn(len(layers), tokens, shape.hidden, generator=g, device=device).to(dtype)
    logits = torch.randn(len(layers), tokens, shape.experts, generator=g, device=device).to(dtype)
    choices = [
        reference_choice(lg.cpu(), shape.top_k, renormalize=False, scoring=spec.scoring) for lg in logits
    ]
    weights, ids = choices[0]
    dense = [w.float() for w in layers[0].dense]
    b13, b2 = layers[0].biases
    want = reference_experts(xs[0], weights, ids, *dense, spec=spec, b13=b13, b2=b2)
    del dense
    pdl = (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and tokens <= SMALL_MAX_TOKENS
    )
    rows = []
    for fmt in FORMATS:
        got = layers[0].run(fused, fmt, xs[0], logits[0], pdl).float()
        rel_rms = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        us = call_timer(device)(lambda i, f=fmt: layers[i].run(fused, f, xs[i], logits[i], pdl), len(layers))
        moved = statistics.mean(call_bytes(shape, c[1], fmt, dtype.itemsize) for c in choices)
        floor_us = moved / (bandwidth_gbps * 1e9) * 1e6
        path = "small" if tokens <= SMALL_MAX_TOKENS else "grouped"
        hit = statistics.mean(len(set(c[1].flatten().tolist())) for c in choices)
        rows.append({"tokens": tokens, "format": fmt, "path": path, "pdl": pdl, "us": us,
                     "floor_us": floor_us, "x_floor": us / floor_us, "GBps": moved / us / 1e3,
                     "bytes": moved, "experts_hit": hit, "rel_rms": rel_rms})  # fmt: skip
        print(
            f"{tokens} token(s), {fmt}: {us:.1f} us, floor {floor_us:.1f} us, rel_rms {rel_rms:.2e}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 64])
    parser.add_argument("--layers", type=int, default=12, help="calls a graph, each with its own weights")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    shape, dtype, device = GPT_OSS_20B, torch.bfloat16, torch.device("cuda")
    if args.tiny:
        shape, dtype, device = TINY, torch.float16, torch.device("cpu")
        args.tokens, args.layers = [t for t in args.tokens if t <= 8] or [1], min(args.layers, 2)
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--tiny runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    ceilings = measure_ceilings(device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        layers = [Layer.draw(shape, dtype, device, g) for _ in range(args.layers)]
        rows = [
            r
            for t in args.tokens
            for r in measure(shape, layers, t, ceilings["copy_bandwidth_GBps"], device, dtype)
        ]
    ratios = {}
    for t in args.tokens:
        mx, bf = (next(r for r in rows if r["tokens"] == t and r["format"] == f) for f in FORMATS)
        ratios[str(t)] = {"mxfp4_over_dense_us": mx["us"] / bf["us"], "mxfp4_x_floor": mx["x_floor"]}
    payload = {
        "config": {"shape": asdict(shape), "dtype": str(dtype), "layers": args.layers, "tokens": args.tokens,
                   "model": "gpt-oss-20b's experts (topk_softmax routing, biases, clamped SwiGLU), dummy "
                            "MXFP4 weights; the dense experts are the same values dequantized to `dtype`"},
        "ceilings": ceilings,
        "rows": rows,
        "mxfp4_vs_dense": ratios,
    }  # fmt: skip
    path = write_record(args.out, "moe-mxfp4", payload, device=device)
    print(f"\n{path}  (copy {ceilings['copy_bandwidth_GBps']} GB/s)")
    print_table(
        rows, ["tokens", "format", "path", "us", "floor_us", "x_floor", "GBps", "experts_hit", "rel_rms"]
    )
    return path


if __name__ == "__main__":
    main()
