"""Whether a decode GEMM gets faster when its weight is pulled into L2 while the GPU waits on latency.

At batch 1 the attention, norm and rope kernels of a layer leave the memory bus idle for ~15 µs, and
the small GEMMs after them (Llama-3.1-8B's o and q/k/v projections) reach only ~72% of the copy
bandwidth, their ramp-up and tail included. A weight does not depend on the activations, so it could
be read into L2 on a side stream during those kernels. This measures, in CUDA graphs, per layer:

- `wait`: a latency-bound stand-in (one-thread spin kernel, ~`--wait-us`) alone;
- `gemm`: the GEMM alone, its weight cold (a different weight copy per layer, more than L2 holds);
- `wait+gemm`: the two in sequence, as now;
- `overlap`: the same with the weight's first `fraction` read into L2 on a side stream during the wait;
- `serial`: prefetch, then GEMM, after the wait (the GEMM's time from L2, without overlap).

    python benchmarks/l2_prefetch.py          # a few seconds on an H200

What the H200 said (l2-prefetch-llama-3.1-8b.json, commit e655f85): it does not pay. Even with the
weight in L2, the o GEMM takes 10.5 µs against 13.6 cold and q/k/v 13.2 against 16.2 (batch 1). That is
~6 µs a layer, ~0.19 ms a step at best. Reading the o weight in took 78 µs with 48 programs (~430 GB/s).
To fit the window it would need most of the SMs, which attention needs at the same moment. So the
engine does not prefetch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from tandem.benchmarks.common import RESULTS, graph_us, measure_ceilings, print_table, write_result

BF16 = torch.bfloat16
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336)}  # Llama-3.1-8B [N, K]


@triton.jit
def _touch(ptr, out, n, per_program, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Read `per_program` elements per program, asking L2 to keep them (evict_last); one sum each."""
    pid = tl.program_id(0)
    start = pid * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, start + per_program, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(ptr + idx, mask=idx < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out + pid, tl.sum(acc, axis=0))


def prefetch(weight: torch.Tensor, fraction: float, out: torch.Tensor, programs: int) -> None:
    flat = weight.view(-1)
    n = int(flat.numel() * fraction)
    per = -(-n // programs)
    per = -(-per // 1024) * 1024
    _touch[(programs,)](flat, out, n, per, BLOCK=1024)


def rows_for(
    name: str, bs: int, wait_cycles: int, fractions: list[float], programs: int
) -> list[dict[str, Any]]:
    n, k = SHAPES[name]
    layers = max(4, -(-400_000_000 // (n * k * 2)))  # several times L2, so each layer's weight is cold
    weights = [torch.randn(n, k, dtype=BF16, device="cuda") * 0.02 for _ in range(layers)]
    x = torch.randn(bs, k, dtype=BF16, device="cuda")
    out = torch.empty(bs, n, dtype=BF16, device="cuda")
    sums = torch.empty(programs, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()

    def wait(j: int) -> None:
        torch.cuda._sleep(wait_cycles)

    def gemm(j: int) -> None:
        torch.mm(x, weights[j].t(), out=out)

    def wait_gemm(j: int) -> None:
        wait(j)
        gemm(j)

    base = {"layer": name, "bs": bs, "weight_mb": round(n * k * 2 / 1e6, 1)}
    wait_us, gemm_us = graph_us(wait, layers), graph_us(gemm, layers)
    seq_us = graph_us(wait_gemm, layers)
    rows = []
    for fraction in fractions:

        def overlapped(j: int, f: float = fraction) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(weights[j], f, sums, programs)
            wait(j)
            main.wait_stream(side)
            gemm(j)

        def serial(j: int, f: float = fraction) -> None:
            wait(j)
            prefetch(weights[j], f, sums, programs)
            gemm(j)

        def prefetch_only(j: int, f: float = fraction) -> None:
            prefetch(weights[j], f, sums, programs)

        over_us, serial_us = graph_us(overlapped, layers), graph_us(serial, layers)
        pre_us = graph_us(prefetch_only, layers)
        rows.append(
            {
                **base,
                "fraction": fraction,
                "wait_us": round(wait_us, 2),
                "gemm_us": round(gemm_us, 2),
                "wait+gemm_us": round(seq_us, 2),
                "prefetch_us": round(pre_us, 2),
                "serial_us": round(serial_us, 2),
                "overlap_us": round(over_us, 2),
                "saved_us": round(seq_us - over_us, 2),
                "gemm_from_l2_us": round(serial_us - wait_us - pre_us, 2),
            }
        )
    weights.clear()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="o,qkv,down")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--fractions", default="0.5,0.75,1.0")
    p.add_argument("--wait-us", type=float, default=15.0, help="the latency-bound stand-in's length")
    p.add_argument("--programs", type=int, default=48, help="prefetch kernel programs (SMs it takes)")
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    # The spin kernel counts clock cycles: calibrate cycles per µs on this device's clock.
    probe = 100_000
    probe_us = graph_us(lambda j: torch.cuda._sleep(probe), 8)
    wait_cycles = int(args.wait_us * probe / probe_us)
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for name in args.layers.split(","):
        for bs in (int(b) for b in args.batches.split(",")):
            rows += rows_for(name, bs, wait_cycles, fractions, args.programs)
    path = write_result(
        "l2-prefetch-llama-3.1-8b" + (f"-{args.tag}" if args.tag else ""),
        {
            "config": {
                "shapes_nk": SHAPES,
                "wait_us_requested": args.wait_us,
                "wait_cycles": wait_cycles,
                "prefetch_programs": args.programs,
                "prefetch": "Triton loads with eviction_policy=evict_last, one fp32 sum per program",
            },
            "ceilings": ceilings,
            "results": rows,
        },
        device=device,
        out_dir=args.out_dir,
    )
    print(path)
    print_table(
        rows,
        [
            "layer",
            "bs",
            "fraction",
            "wait_us",
            "gemm_us",
            "wait+gemm_us",
            "prefetch_us",
            "overlap_us",
            "saved_us",
            "gemm_from_l2_us",
        ],
    )


if __name__ == "__main__":
    main()
