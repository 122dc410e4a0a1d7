"""Decode latency: ms per step of a Llama-3.1-8B-shaped model (random bf16 weights) at batch 1, 8 and
64 with 512 tokens of context, with and without decode CUDA graphs, against the roofline floor

    floor = max((weight bytes + batch x KV bytes at the context) / copy bandwidth,
                decode FLOPs / bf16 matmul rate)

from bandwidth and matmul rate measured in the same run. Steps run straight through the Engine
(see engine_steps.py): plan, forward, sampling and the result copy, pipelined one step deep.

    python benchmarks/decode.py --quick     # 8 of the 32 layers: about 2 minutes on an H200
    python benchmarks/decode.py             # all 32 layers
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import (
    RESULTS,
    bar_chart,
    measure_ceilings,
    print_table,
    release_memory,
    write_result,
)
from tandem.benchmarks.engine_steps import PAGE, build_engine, decode_batch, seconds_per_step
from tandem.benchmarks.shapes import LLAMA_3_1_8B, ModelCost, write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 layers instead of 32, fewer steps")
    parser.add_argument("--layers", type=int, default=None, help="default: 32 (quick: 8)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per repeat (default 100, quick 40)"
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--fused-decode-max-bs", type=int, default=None, help="the engine option (default: its default)"
    )
    parser.add_argument(
        "--engine",
        type=json.loads,
        default={},
        help='more engine options as JSON, e.g. \'{"pdl_max_bs": 8, "small_gemm_max_bs": 8}\'',
    )
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    layers = args.layers or (8 if args.quick else LLAMA_3_1_8B["num_hidden_layers"])
    steps = args.steps or (40 if args.quick else 100)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    ceilings = measure_ceilings(device)
    shape = {**LLAMA_3_1_8B, "num_hidden_layers": layers}
    start = time.perf_counter()
    model_dir = write_random_model(
        args.model_dir or Path(f"/tmp/tandem-bench/llama-8b-{layers}l"), "llama", device=device, **shape
    )
    model_s = time.perf_counter() - start
    # A fresh host spends minutes here (16 GB of random weights written, then loaded): say so.
    print(f"model at {model_dir} in {model_s:.0f} s; building the engine", flush=True)
    num_pages = sum(batches) * -(-(args.context + 1) // PAGE) + 64
    start = time.perf_counter()
    engine = build_engine(
        model_dir,
        device,
        num_pages=num_pages,
        cuda_graph=True,
        max_bs=max(batches),
        fused_decode_max_bs=args.fused_decode_max_bs,
        options=args.engine,
    )
    print(
        f"engine in {time.perf_counter() - start:.0f} s (graph capture {engine.capture_seconds:.0f} s)",
        flush=True,
    )
    cost = ModelCost.of(engine.model_config)
    bandwidth, rate = ceilings["copy_bandwidth_GBps"] * 1e9, ceilings["bf16_matmul_TFLOPs"] * 1e12
    graphs = engine.decode_graphs
    rows: list[dict[str, Any]] = []
    for batch_size in batches:
        batch = decode_batch(engine, [args.context] * batch_size)
        floor = cost.decode_step_floor([args.context] * batch_size, bandwidth, rate)
        row: dict[str, Any] = {"batch": batch_size, "context": args.context, "floor_ms": floor * 1e3}
        for mode in ("graph", "eager"):
            engine.decode_graphs = graphs if mode == "graph" else None  # same engine, same pool
            row[f"{mode}_ms"] = seconds_per_step(engine, batch, steps=steps) * 1e3
            row[f"{mode}_pct_of_floor"] = 100 * row["floor_ms"] / row[f"{mode}_ms"]
        engine.decode_graphs = graphs
        rows.append(row)
        print(
            f"batch {batch_size}: {row['graph_ms']:.3f} ms/step with graphs, floor {row['floor_ms']:.3f}",
            flush=True,
        )
    switches = engine.config.switches()
    del engine, graphs
    release_memory()
    name = f"decode-llama-3.1-8b-{layers}l" + (f"-{args.tag}" if args.tag else "")
    path = write_result(
        name,
        {
            "config": {
                "model": "Llama-3.1-8B shape, random bf16 weights",
                "model_shape": shape,
                "context": args.context,
                "batches": batches,
                "steps_per_repeat": steps,
                "sampling": "temperature 0.6",
                "switches": switches,
            },
            "ceilings": ceilings,
            "floor_formula": "max((weights + batch x KV at context) / copy bandwidth, FLOPs / matmul rate)",
            "model_write_s": model_s,
            "results": rows,
        },
        device=device,
        out_dir=args.out_dir,
    )
    labels = [f"bs{r['batch']} {m}" for r in rows for m in ("floor", "graph", "eager")]
    values = [r[f"{m}_ms"] for r in rows for m in ("floor", "graph", "eager")]
    bar_chart(path.with_suffix(".png"), labels, values, ylabel="ms / decode step", title=name)
    print(f"\n{path}  ({ceilings})")
    print_table(
        rows,
        ["batch", "context", "floor_ms", "graph_ms", "graph_pct_of_floor", "eager_ms", "eager_pct_of_floor"],
    )


if __name__ == "__main__":
    main()
