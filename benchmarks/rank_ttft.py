"""Time to first token inside one rank: a `RankRuntime` driven in this process, no Ray, no channel.

The serve-overhead benchmark compares HTTP against `LLMReplica.generate`, and both share the rank's own
first-token time, which can be larger than the overhead being measured and moves between runs
(docs/serve-config.md#serve-overhead). This splits it: sequential requests at low load,
the time from handing the request to the loop until the loop emits its first token, how many loop steps
that took, and the loop's phases per step (schedule, launch, process_results with `wait` inside it).

    python benchmarks/rank_ttft.py --device cuda --out-dir OUT
    python benchmarks/rank_ttft.py --device cuda --profile 10 --out-dir OUT   # and where the host time goes

`--profile N` runs N more requests per setting under torch.profiler and writes the host ops by self CPU
time (rank-ttft-<device>-<setting>-profile.txt): a step of the tiny model launched in ~4 ms on an H200,
a hidden synchronisation or pinned allocation shows up there by name. Then N more under cProfile
(...-python.txt, by cumulative time): the Python functions the profiler's ops do not name (planners).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import RESULTS, write_result
from tandem.engine.distributed import TPGroup
from tandem.engine.tiny.factory import default_model_dir
from tandem.scheduler.messages import AddRequest, SamplingSpec, SchedulerMsg, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions


def measure(
    runtime: RankRuntime,
    emitted: list[float],
    requests: int,
    prompt_len: int,
    max_tokens: int,
    warmup: int = 3,
) -> dict[str, Any]:
    """Per request: seconds to the first emitted token and to the last, and loop steps to the first.
    `emitted` is where the runtime's emit callback appends the time of each batch of outputs."""
    inbox: list[SchedulerMsg] = []

    def receive(blocking: bool) -> list[SchedulerMsg]:
        msgs = list(inbox)
        inbox.clear()
        return msgs

    first, total, steps = [], [], []
    for i in range(requests + warmup):
        emitted.clear()
        prompt = [(i * 7 + k) % 400 + 5 for k in range(prompt_len)]
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        inbox.append(AddRequest(rid=i, prompt_ids=prompt, sampling=spec))
        start, count, to_first = time.perf_counter(), 0, None
        while True:
            runtime.step(receive)
            count += 1
            if to_first is None and emitted:
                to_first = count
            if not runtime.busy:
                break
        if i >= warmup and emitted and to_first is not None:
            first.append(emitted[0] - start)
            total.append(emitted[-1] - start)
            steps.append(to_first)
    return {
        "ttft_ms_p50": round(1e3 * statistics.median(first), 3),
        "ttft_ms_p90": round(1e3 * statistics.quantiles(first, n=10)[-1], 3),
        "e2e_ms_p50": round(1e3 * statistics.median(total), 3),
        "steps_to_first_token": statistics.median(steps),
    }


def profile_table(
    runtime: RankRuntime, emitted: list[float], requests: int, prompt_len: int, max_tokens: int
) -> str:
    """`requests` more requests under torch.profiler: the ops by self CPU time, as a text table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        measure(runtime, emitted, requests, prompt_len, max_tokens, warmup=0)
    return str(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    )


def python_profile(
    runtime: RankRuntime, emitted: list[float], requests: int, prompt_len: int, max_tokens: int
) -> str:
    """`requests` more requests under cProfile: the 40 functions with the most cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(measure, runtime, emitted, requests, prompt_len, max_tokens, 0)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--profile", type=int, default=0, help="Requests to run under torch.profiler after timing."
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    # mem_fraction caps the whole device's use: should the first runtime's memory outlive `del` (the
    # caching allocator, CUDA graphs), the second still finds room under its larger cap.
    for overlap, mem_fraction in ((True, 0.3), (False, 0.7)):
        options = RuntimeOptions.of(device=args.device, overlap=overlap, mem_fraction=mem_fraction)
        emitted: list[float] = []

        def emit(outputs: list[TokenOutput], emitted: list[float] = emitted) -> None:
            emitted.append(time.perf_counter())

        runtime = RankRuntime(default_model_dir(), options, TPGroup(), emit)
        runtime.scheduler.timer.reset()
        timing = measure(runtime, emitted, args.requests, args.prompt_len, args.max_tokens)
        row = {"overlap": overlap, **timing}
        row["step_phases"] = runtime.scheduler.timer.summary()
        rows.append(row)
        print({k: v for k, v in row.items() if k != "step_phases"}, flush=True)
        if args.profile:
            table = profile_table(runtime, emitted, args.profile, args.prompt_len, args.max_tokens)
            setting = "overlap" if overlap else "no-overlap"
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"rank-ttft-{args.device}-{setting}-profile.txt").write_text(table)
            print("\n".join(table.splitlines()[:20]), flush=True)
            calls = python_profile(runtime, emitted, args.profile, args.prompt_len, args.max_tokens)
            (args.out_dir / f"rank-ttft-{args.device}-{setting}-python.txt").write_text(calls)
        del runtime
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    config = vars(args) | {"out_dir": str(args.out_dir), "model": "demo model"}
    payload = {"config": config, "rows": rows}
    path = write_result(
        f"rank-ttft-{args.device}", payload, device=torch.device(args.device), out_dir=args.out_dir
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
