"""Where the offline run's time goes, step by step, without a profiler: CUDA events around every forward.

    python benchmarks/step_trace.py                          # the offline workload, the engine's defaults
    python benchmarks/step_trace.py --engine '{"fused_decode_max_bs": 0}' --tag fused-off

Each forward (one scheduler step) records an event on the engine stream before and after its launches.
Per step that gives the device's time on the step (from the stream reaching the step to finishing it) and
the device's idle time before it (the stream waited for the host to launch). Steps are grouped by kind
and batch size, with each group's KV and weight bytes read against its device time: which batch sizes run
near the copy bandwidth and which do not, and how much of the run the device sits idle. The events cost
a few µs of host time a step; the run's own tok/s is printed to show they change little.
"""

from __future__ import annotations

import argparse
import json
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
