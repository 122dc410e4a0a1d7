"""Where the offline run's time goes, step by step, without a profiler: CUDA events around every forward.

    python benchmarks/step_trace.py                          # the offline workload, the engine's defaults
    python benchmarks/step_trace.py --engine '{"fused_decode_max_bs": 0}' --tag fused-off
    python benchmarks/step_trace.py --small-batch     # batch 1 and 8: ms per token and a b1 step's kernels

Each forward (one scheduler step) records an event on the engine stream before and after its launches.
Per step that gives the device's time on the step (from the stream reaching the step to finishing it) and
the device's idle time before it (the stream waited for the host to launch). Steps are grouped by kind
and batch size, with each group's KV and weight bytes read against its device time: which batch sizes run
near the copy bandwidth and which do not, and how much of the run the device sits idle. The events cost
a few µs of host time a step; the run's own tok/s is printed to show they change little.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import RESULTS, measure_ceilings, write_result
from tandem.benchmarks.offline import pages_for, workload
from tandem.benchmarks.shapes import QWEN3_0_6B, ModelCost, write_random_model
from tandem.engine.config import ModelConfig

BUCKETS = (1, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class StepEvents:
    """Wraps an engine's `forward`: per call its kind, rows and KV tokens, and two timing events."""

    def __init__(self, engine: Any) -> None:
        self.steps: list[tuple[bool, int, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._forward = engine.forward
        engine.forward = self

    def __call__(self, batch: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._forward(batch)
        end.record()
        kv = int(batch.seq_lens_cpu.sum()) if batch.is_decode else 0
        self.steps.append((batch.is_decode, batch.batch_size, kv, start, end))
        return out


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS if rows <= b) if rows <= BUCKETS[-1] else rows


def summarize(steps: list[Any], cost: ModelCost, bandwidth: float) -> dict[str, Any]:
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    previous_end = None
    for decode, rows, kv_tokens, start, end in steps:
        name = f"decode <= {bucket(rows)}" if decode else "prefill/extend"
        g = groups[name]
        g["steps"] += 1
        g["device_ms"] += start.elapsed_time(end)
        g["idle_ms"] += 0.0 if previous_end is None else max(previous_end.elapsed_time(start), 0.0)
        if decode:
            g["floor_ms"] += 1e3 * (cost.weight_bytes + cost.kv_read_bytes(kv_tokens)) / bandwidth
        previous_end = end
    table = {}
    for name, g in sorted(
        groups.items(), key=lambda kv: (kv[0][0], int(kv[0].split()[-1]) if "<=" in kv[0] else 0)
    ):
        row = {k: round(v, 3) for k, v in g.items()}
        if g["floor_ms"]:
            row["percent_of_floor"] = round(100 * g["floor_ms"] / g["device_ms"], 1)
        table[name] = row
    return table


def host_profile(profiler: cProfile.Profile, steps: int, top: int = 40) -> dict[str, list[Any]]:
    """The host's functions by own time and by cumulative time, µs per step (cProfile's overhead
    included, so each figure is an upper bound; the ranking is what matters)."""
    stats = pstats.Stats(profiler)
    entries = [
        (f"{Path(file).name}:{line}:{name}", calls, own, cumulative)
        for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]

    def table(key: int) -> list[Any]:
        ranked = sorted(entries, key=lambda e: -e[key])[:top]
        return [
            [where, round(calls / steps, 2), round(1e6 * own / steps, 1), round(1e6 * cum / steps, 1)]
            for where, calls, own, cum in ranked
        ]

    return {
        "columns": ["function", "calls", "own_us", "cumulative_us"],
        "by_own": table(2),
        "by_cumulative": table(3),
    }


def small_batch(llm: LLM, prompts: list[list[int]], cost: ModelCost, bandwidth: float) -> dict[str, Any]:
    """Decode at batch 1 and 8, measured as a user sees it: one `generate` of N rows, 32 tokens against
    32 + 1,024, the difference over 1,024 tokens. Then one batch-1 run again under CUDA events (device
    time and idle per step) and under torch.profiler (each kernel's device time per step), with the
    loop's host phases, so a slow step splits into host and device work and the device work by kernel."""
    extra = 1024

    def run(rows: int, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.6, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([p[:32] for p in prompts[:rows]], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    out: dict[str, Any] = {}
    for rows in (1, 8):
        run(rows, 32)  # warm-up: this batch size's graph and kernels
        short, long = min(run(rows, 32) for _ in range(2)), min(run(rows, 32 + extra) for _ in range(2))
        out[f"ms_per_token_b{rows}"] = round(1e3 * (long - short) / extra, 4)
    timer = llm.runtime.scheduler.timer
    timer.reset()
    events = StepEvents(llm.runtime.engine)
    run(1, 32 + extra)
    llm.runtime.engine.forward = events._forward
    decode = [s for s in events.steps if s[0]]
    device_ms = [s[3].elapsed_time(s[4]) for s in decode]
    idle_ms = [max(a[4].elapsed_time(b[3]), 0.0) for a, b in itertools.pairwise(decode)]
    floor_ms = 1e3 * (cost.weight_bytes + cost.kv_read_bytes(32 + extra // 2)) / bandwidth
    steps = 64
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(1, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    run(1, 32 + 256)
    profiler.disable()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    per_step = {e.key[:90]: round(e.device_time_total / steps, 2) for e in kernels[:25]}
    out["breakdown"] = {
        "device_ms_per_step": round(sum(device_ms) / len(device_ms), 4),
        "idle_ms_per_step": round(sum(idle_ms) / max(len(idle_ms), 1), 4),
        "floor_ms_per_step": round(floor_ms, 4),
        "host_phases": timer.summary(),
        "kernel_us_per_step": per_step,
        "kernel_launches_per_step": round(sum(e.count for e in kernels) / steps, 1),
        "kernel_note": f"torch.profiler over {steps} tokens of one request, prefill included; top 25",
        "host_profile_us_per_step": host_profile(profiler, 32 + 256),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="{}", help="JSON of engine options (LLM keyword arguments)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=100)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=100)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--small-batch", action="store_true", help="batch 1 and 8 (step-b1-<tag>.json)")
    args = parser.parse_args()
    options = json.loads(args.engine)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_bandwidth_GBps"] * 1e9
    prompts, params = workload(args)
    model_dir = write_random_model(Path("/tmp/tandem-bench/qwen3-0.6b"), "qwen3", device=device, **QWEN3_0_6B)
    cost = ModelCost.of(ModelConfig.from_dir(model_dir))  # no window layers: KV bytes are linear in tokens
    llm = LLM(
        str(model_dir),
        device="cuda",
        page_size=16,
        num_pages=pages_for(prompts, params),
        max_running=256,
        chunk_size=8192,
        **options,
    )
    llm.generate(prompts[:8], SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True), use_tqdm=False)
    if args.small_batch:
        payload = {"config": {"model": "qwen3-0.6b shape", "engine": options}, "ceilings": ceilings}
        payload |= small_batch(llm, prompts, cost, bandwidth)
        payload["config"]["switches"] = llm.runtime.engine.config.switches()
        llm.shutdown()
        write_result(f"step-b1-{args.tag or 'h200'}", payload, device=device, out_dir=args.out_dir)
        print(json.dumps({k: v for k, v in payload.items() if k.startswith("ms_")}))
        print(json.dumps(payload["breakdown"], indent=1))
        return
    events = StepEvents(llm.runtime.engine)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    switches = llm.runtime.engine.config.switches()
    llm.shutdown()
    table = summarize(events.steps, cost, bandwidth)
    device_ms = sum(r["device_ms"] for r in table.values())
    idle_ms = sum(r["idle_ms"] for r in table.values())
    payload = {
        "config": {
            "workload": "offline.py defaults",
            "engine": options,
            "switches": switches,
        },
        "ceilings": ceilings,
        "elapsed_s": round(elapsed, 4),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "device_s": round(device_ms / 1e3, 4),
        "idle_s": round(idle_ms / 1e3, 4),
        "groups": table,
    }
    name = "step-trace-qwen3-0.6b" + (f"-{args.tag}" if args.tag else "")
    write_result(name, payload, device=device, out_dir=args.out_dir)
    print(f"{'group':<16} {'steps':>6} {'device ms':>10} {'idle ms':>8} {'floor ms':>9} {'% floor':>8}")
    for group, r in table.items():
        pct = r.get("percent_of_floor", "")
        cells = f"{r['steps']:6.0f} {r['device_ms']:10.1f} {r['idle_ms']:8.1f} {r.get('floor_ms', 0.0):9.1f}"
        print(f"{group:<16} {cells} {pct:>8}")
    print(f"{tokens / elapsed:,.0f} tok/s, {elapsed:.3f} s", end="; ")
    print(f"device {device_ms / 1e3:.3f} s, idle {idle_ms / 1e3:.3f} s")


if __name__ == "__main__":
    main()
