"""Where one overlap-loop step spends its time: a torch.profiler table over a short offline run.

    python benchmarks/profile_steps.py --num-seqs 64 --max-output 200

Prints the top operators by self CPU time and by self CUDA time, and the loop's own ranges
(tandem.schedule, tandem.launch, tandem.process_results, tandem.d2h_copy).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.benchmarks.shapes import QWEN3_0_6B, write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=200)
    parser.add_argument("--min-output", type=int, default=None, help="Default: --max-output (fixed lengths).")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    random.seed(0)
    prompts = [
        [random.randint(0, 9999) for _ in range(random.randint(100, 1024))] for _ in range(args.num_seqs)
    ]
    low = args.min_output or args.max_output
    params = [
        SamplingParams(max_tokens=random.randint(low, args.max_output), temperature=0.6, ignore_eos=True)
        for _ in range(args.num_seqs)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(
            Path(tmp) / "qwen3", "qwen3", device=torch.device("cuda"), **QWEN3_0_6B
        )
        llm = LLM(str(model_dir), device="cuda", num_pages=20000)
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up: graphs, kernels
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    table = prof.key_averages()
    # Whether the run waits on the device or the device waits on the host: the kernels' summed time
    # against the wall time (the profiler slows the host, so a busy fraction near 1 is a lower bound).
    busy = sum(e.self_device_time_total for e in table if e.device_type == DeviceType.CUDA) / 1e6
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=48))
    print(f"wall {wall:.3f} s; kernels {busy:.3f} s; device busy {100 * busy / wall:.1f}%")


if __name__ == "__main__":
    main()
