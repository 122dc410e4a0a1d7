"""Where a decode step's time goes, for the decode-latency target (Llama-3.1-8B shape, batch 1, 8, 64).

For each batch size it reports, from one engine with decode CUDA graphs:
- the whole step (plan, graph, logits, sampling, result copy, pipelined as the overlap loop runs it);
- the graph replay alone (the model body, back to back), so the rest is logits, sampling and host;
- the kernels of the step by family (GEMM, attention, norm, rope, KV store, activation, sampling),
  from torch.profiler, in microseconds per step and launches per step;
and, on their own, each weight GEMM at that batch size against the copy bandwidth, over enough weight
copies that L2 (50 MB on an H200) serves none of them.

    python benchmarks/decode_profile.py --layers 32 --batches 1,8,64
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tandem.benchmarks.common import RESULTS, cuda_times, measure_ceilings, print_table, write_result
from tandem.benchmarks.engine_steps import PAGE, build_engine, decode_batch, seconds_per_step
from tandem.benchmarks.shapes import SHAPES, ModelCost, write_random_model
from tandem.engine.engine import Engine

# First match wins; names are CUDA kernel names as the profiler reports them.
FAMILIES = [
    ("attention", r"BatchPrefill|BatchDecode|MergeStates|PersistentKernel|VariableLength"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|splitK|Kernel2"),
    ("norm", r"RMSNorm|Norm"),
    ("rope", r"[Rr]ope|RotaryEmbedding"),
    ("activation", r"act_and_mul|silu|gelu"),
    ("kv_store", r"index_put|indexing_backward|index_elementwise"),
    ("sampling", r"exponential|argmax|reduce_kernel|distribution|log_|div|sort"),
]


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, name)), "other")


def kernel_times(engine: Engine, batch: Any, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, µs per step, launches per step) over `steps` whole steps, longest first. On CPU
    (smoke runs) these are operators' self CPU times instead."""
    cuda = engine.config.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.forward(batch).copy_done.synchronize()
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and not event.key.startswith(("cuda", "Memcpy", "Memset")):
            rows.append((event.key, us / steps, event.count / steps))
    return sorted(rows, key=lambda row: row[1], reverse=True)


def by_family(kernels: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    families: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "launches": 0.0})
    for key, us, count in kernels:
        row = families[family(key)]
        row["us"] += us
        row["launches"] += count
    return dict(families)


def per_call_us(fn: Any, *, reps: int = 20, pairs: int = 7) -> float:
    """Median µs per call over `pairs` runs of `reps` back-to-back calls: launch gaps between calls
    hide behind the queue, as they do inside a step."""

    def run() -> None:
        for _ in range(reps):
            fn()

    return sorted(cuda_times(run, iters=pairs))[pairs // 2] * 1e6 / reps


def gemm_us(n: int, k: int, batches: list[int], device: torch.device) -> list[float]:
    """µs per x @ W^T for W [n, k] at each batch size, cycling over copies of W (> 256 MB in all)."""
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    times = []
    for m in batches:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        turn = itertools.cycle(weights)
        times.append(per_call_us(lambda x=x, turn=turn: F.linear(x, next(turn))))
    return times


def gemm_rows(
    shape: dict[str, int], batches: list[int], bandwidth: float, device: torch.device
) -> list[dict[str, Any]]:
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
    shapes["lm_head"] = (shape["vocab_size"], h)
    rows = []
    for name, (n, k) in shapes.items():
        for m, us in zip(batches, gemm_us(n, k, batches, device), strict=True):
            floor_us = n * k * 2 / bandwidth * 1e6
            rows.append(
                {
                    "gemm": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "us": us,
                    "floor_us": floor_us,
                    "pct_of_bandwidth": 100 * floor_us / us,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's own count")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--fused-decode-max-bs", type=int, default=None, help="the engine option (default: its default)"
    )
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--gemm-shape", default="", help="e.g. 64,128,64: a smaller GEMM set (smoke tests)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_bandwidth_GBps"] * 1e9
    family, base = SHAPES[args.shape]
    layers = args.layers or base["num_hidden_layers"]
    shape = {**base, "num_hidden_layers": layers}
    gemm_shape = dict(shape)
    if args.gemm_shape:
        h, i, v = (int(x) for x in args.gemm_shape.split(","))
        gemm_shape.update(
            hidden_size=h,
            intermediate_size=i,
            vocab_size=v,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=h,
        )
    gemms = gemm_rows(gemm_shape, batches, bandwidth, device)
    model_dir = write_random_model(
        Path(f"/tmp/tandem-bench/{args.shape}-{layers}l"), family, device=device, **shape
    )
    num_pages = sum(batches) * -(-(args.context + 1) // PAGE) + 64
    engine = build_engine(
        model_dir,
        device,
        num_pages=num_pages,
        cuda_graph=True,
        max_bs=max(batches),
        fused_decode_max_bs=args.fused_decode_max_bs,
    )
    graphs = engine.decode_graphs
    cost = ModelCost.of(engine.model_config)
    rate = ceilings["bf16_matmul_TFLOPs"] * 1e12
    steps: list[dict[str, Any]] = []
    kernels: dict[int, Any] = {}
    for bs in batches:
        batch = decode_batch(engine, [args.context] * bs)
        step_ms = seconds_per_step(engine, batch, steps=args.steps) * 1e3
        replay_ms = None
        graph_bs = graphs.padded_size(batch) if graphs is not None else None
        if graphs is not None and graph_bs is not None:
            with torch.inference_mode():  # the graph's static buffers are inference tensors
                graphs.run(batch, graph_bs)
            replay_ms = per_call_us(graphs.graphs[(graph_bs, False)].replay, reps=10, pairs=5) / 1e3
        # Kernels inside graph replays may not reach the profiler, so families come from eager steps
        # (the same kernels; only the gaps between them differ). The top list is of graph steps.
        top = [(key[:90], us, count) for key, us, count in kernel_times(engine, batch, 5)[:12]]
        engine.decode_graphs = None
        table = by_family(kernel_times(engine, batch, 10))
        engine.decode_graphs = graphs
        kernels[bs] = {"families_eager": table, "top_graph": top}
        busy = sum(f["us"] for f in table.values()) / 1e3
        steps.append(
            {
                "batch": bs,
                "step_ms": step_ms,
                "floor_ms": cost.decode_step_floor([args.context] * bs, bandwidth, rate) * 1e3,
                "graph_replay_ms": replay_ms,
                "kernel_busy_ms": busy,
                **{f"{name}_us": round(f["us"], 1) for name, f in sorted(table.items())},
            }
        )
    switches = engine.config.switches()
    name = f"decode-profile-{args.shape}-{layers}l" + (f"-{args.tag}" if args.tag else "")
    path = write_result(
        name,
        {
            "config": {
                "model_shape": shape,
                "context": args.context,
                "batches": batches,
                "switches": switches,
            },
            "ceilings": ceilings,
            "steps": steps,
            "kernels": kernels,
            "gemms": gemms,
        },
        device=device,
        out_dir=args.out_dir,
    )
    for bs in batches:
        print(f"\nbatch {bs}: top kernels (µs/step, launches/step)")
        for key, us, count in kernels[bs]["top_graph"]:
            print(f"  {us:9.1f} {count:6.1f}  {key}")
    print(f"\n{path}")
    print_table(gemms, ["gemm", "m", "us", "floor_us", "pct_of_bandwidth"])
    print_table(steps, list(steps[0].keys()))


if __name__ == "__main__":
    main()
