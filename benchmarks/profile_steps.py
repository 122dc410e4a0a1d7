"""Where the offline run's device time goes: a torch.profiler table over the offline workload.

    python benchmarks/profile_steps.py               # the exact offline workload (offline.py defaults)
    python benchmarks/profile_steps.py --num-seqs 64 --max-output 200

Prints the top operators by self CPU time and by self CUDA time, the kernels' time by kind (attention,
GEMMs, norms, sampling, ...) per loop step, and the kernels' summed time against the wall time. The
profiler slows the host several-fold, so the wall time here is not the benchmark's; the kernel times
are, and `offline.py`'s wall time minus their sum is what the device spends idle in the real run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.benchmarks.offline import add_workload_args, pages_for, workload
from tandem.benchmarks.shapes import QWEN3_0_6B, write_random_model

# Kernel name fragment -> kind; the first match wins, so the specific fragments come first.
KINDS = (
    ("BatchPrefillWithPagedKVCache", "attention"),
    ("BatchDecodeWithPagedKVCache", "attention"),
    ("MergeStates", "attention"),
    ("AppendPagedKVCache", "kv append"),
    ("qk_norm_rope", "q/k norm + rope"),
    ("RMSNorm", "rms norms"),
    ("act_and_mul", "activation"),
    ("race_", "sampling"),
    ("sampling", "sampling"),
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("splitK", "gemm"),
    ("Memcpy", "memcpy"),
    ("elementwise", "elementwise"),
    ("reduce", "elementwise"),
)


def kind_of(name: str) -> str:
    return next((kind for fragment, kind in KINDS if fragment in name), "other")


def kernel_kinds(table: Any) -> dict[str, float]:
    """Seconds of device time per kind of kernel (user ranges, which the profiler also lists on the
    device timeline, are left out: they would count their kernels twice)."""
    out: dict[str, float] = defaultdict(float)
    for e in table:
        if e.device_type == DeviceType.CUDA and not e.key.startswith("tandem."):
            out[kind_of(e.key)] += e.self_device_time_total / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    prompts, params = workload(args)
    num_pages = pages_for(prompts, params)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(
            Path(tmp) / "qwen3", "qwen3", device=torch.device("cuda"), **QWEN3_0_6B
        )
        llm = LLM(
            str(model_dir), device="cuda", page_size=16, num_pages=num_pages, max_running=256, chunk_size=8192
        )
        warm = SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)
        llm.generate(prompts[:8], warm, use_tqdm=False)  # warm-up: graphs, kernels
        timer = llm.runtime.scheduler.timer
        timer.reset()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        steps = timer.summary().get("launch", {}).get("calls", 0) or 1
        llm.shutdown()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=48))
    kinds = kernel_kinds(table)
    busy = sum(kinds.values())
    print(f"{'kernel kind':<18} {'total s':>8} {'ms/step':>8} {'share':>6}   ({steps} steps)")
    for kind, seconds in kinds.items():
        print(f"{kind:<18} {seconds:8.3f} {1e3 * seconds / steps:8.3f} {100 * seconds / busy:5.1f}%")
    print(f"wall {wall:.3f} s under the profiler; kernels {busy:.3f} s ({1e3 * busy / steps:.3f} ms/step)")


if __name__ == "__main__":
    main()
