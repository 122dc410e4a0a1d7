"""Sliding-window decode: a Gemma-3-1B-shaped model (26 layers, 5 window layers of 512 tokens per global
layer; random bf16 weights) decoding at 1k and 16k context. With eviction the window layers read only
their last ~window tokens' pages, so going from 1k to 16k costs only the global layers' extra reads.
The "no eviction" rows list every page and let flashinfer's window_left mask them: it still reads them.

    floor = max((weight bytes + KV bytes actually listed) / copy bandwidth, FLOPs / matmul rate)

    python benchmarks/window.py --quick     # batch 8: about 2 minutes on an H200
    python benchmarks/window.py             # batch 16, more steps
"""

from __future__ import annotations

import argparse
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
from tandem.benchmarks.shapes import GEMMA_3_1B, ModelCost, write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="batch 8, fewer steps")
    parser.add_argument("--batch", type=int, default=None, help="default 16 (quick: 8)")
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per repeat (default 100, quick 40)"
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench/gemma-3-1b"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    batch_size = args.batch or (8 if args.quick else 16)
    steps = args.steps or (40 if args.quick else 100)
    contexts = [int(c) for c in args.contexts.split(",")]
    device = torch.device(args.device)
    ceilings = measure_ceilings(device)
    start = time.perf_counter()
    model_dir = write_random_model(args.model_dir, "gemma3", device=device, **GEMMA_3_1B)
    model_s = time.perf_counter() - start
    num_pages = batch_size * -(-max(contexts) // PAGE) + 64
    engine = build_engine(model_dir, device, num_pages=num_pages, cuda_graph=True, max_bs=batch_size)
    cost = ModelCost.of(engine.model_config)
    bandwidth, rate = ceilings["copy_bandwidth_GBps"] * 1e9, ceilings["bf16_matmul_TFLOPs"] * 1e12
    rows: list[dict[str, Any]] = []
    for context in contexts:
        for evict in (True, False):
            torch.manual_seed(context)  # the same pages with and without eviction
            batch = decode_batch(engine, [context] * batch_size, evict=evict)
            floor = cost.decode_step_floor([context] * batch_size, bandwidth, rate, evict=evict)
            ms = seconds_per_step(engine, batch, steps=steps) * 1e3
            rows.append(
                {
                    "context": context,
                    "eviction": evict,
                    "ms_per_step": ms,
                    "floor_ms": floor * 1e3,
                    "pct_of_floor": 100 * floor * 1e3 / ms,
                    "kv_read_MB_per_row": cost.kv_read_bytes(context, evict=evict) / 1e6,
                }
            )
            print(
                f"context {context}, eviction {evict}: {ms:.3f} ms/step (floor {floor * 1e3:.3f})", flush=True
            )
    switches = engine.config.switches()
    del engine
    release_memory()
    name = f"window-gemma-3-1b-bs{batch_size}" + (f"-{args.tag}" if args.tag else "")
    path = write_result(
        name,
        {
            "config": {
                "model": "Gemma-3-1B shape, random bf16 weights",
                "model_shape": GEMMA_3_1B,
                "batch": batch_size,
                "contexts": contexts,
                "steps_per_repeat": steps,
                "switches": switches,
            },
            "ceilings": ceilings,
            "floor_formula": "max((weights + listed KV) / copy bandwidth, FLOPs / matmul rate)",
            "model_write_s": model_s,
            "results": rows,
        },
        device=device,
        out_dir=args.out_dir,
    )
    labels = [f"{r['context'] // 1024}k {'evict' if r['eviction'] else 'no-evict'}" for r in rows]
    bar_chart(
        path.with_suffix(".png"),
        labels,
        [r["ms_per_step"] for r in rows],
        ylabel="ms / decode step",
        title=name,
    )
    print(f"\n{path}  ({ceilings})")
    print_table(
        rows, ["context", "eviction", "ms_per_step", "floor_ms", "pct_of_floor", "kv_read_MB_per_row"]
    )


if __name__ == "__main__":
    main()
