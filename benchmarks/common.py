"""Shared by the GPU benchmarks: device and commit identity, the machine's own ceilings (measured in the
same run), CUDA-event timing, and result files (JSON always, PNG when matplotlib is installed).

Every result file names the device, the commit and the configuration it was measured with.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """Short HEAD hash, with "-dirty" when tracked files differ from it.

    GPU hosts get a copy of the tree without .git, so TANDEM_COMMIT (set in the device command from
    the checkout that was sent) takes precedence.
    """
    given = os.environ.get("TANDEM_COMMIT")
    if given:
        return given
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("diff", "--quiet", "HEAD").returncode != 0
    return f"{head}-dirty" if dirty else head


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
        try:
            import flashinfer

            info["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
        except Exception as exc:  # reported, not fatal: the torch backend still runs
            info["flashinfer"] = f"unavailable: {exc!r}"
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_times(fn: Callable[[], object], *, iters: int, warmup: int = 3) -> list[float]:
    """Seconds per call of `fn`, one CUDA-event pair per call, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke runs of the scripts
        return [_wall(fn) for _ in range(iters)]
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in pairs]


def measure_ceilings(
    device: torch.device, *, copy_gib: float = 2.0, matmul_n: int = 8192
) -> dict[str, float]:
    """What this GPU does right now: device-to-device copy bandwidth (bytes read + written per second)
    and dense bf16 matmul rate. Random data, never zeros: zeros draw less power and clock higher."""
    if device.type != "cuda":  # CPU smoke runs: small, so they finish
        copy_gib, matmul_n = 0.125, 1024
    bandwidth = _copy_bandwidth(device, int(copy_gib * 2**30))
    rate = _matmul_rate(device, matmul_n)
    release_memory()
    return {
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "bf16_matmul_TFLOPs": round(rate / 1e12, 1),
        "copy_gib": copy_gib,
        "matmul_n": matmul_n,
    }


def _copy_bandwidth(device: torch.device, n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * n / statistics.median(cuda_times(lambda: dst.copy_(src), iters=10))


def _matmul_rate(device: torch.device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty_like(a)
    return 2 * n**3 / statistics.median(cuda_times(lambda: torch.mm(a, b, out=c), iters=10))


def _wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def release_memory() -> None:
    """Free what the last engine held before building the next one in this process."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def allocator_counters() -> dict[str, float]:
    """Running totals of the CUDA allocators' slow paths: pinned host blocks created (cudaHostAlloc) and
    the time they took, device segments created (cudaMalloc) and allocation retries (a full cache flushed
    and tried again). Differences across a run say whether it grew either pool; empty off CUDA."""
    if not torch.cuda.is_available():
        return {}
    counters: dict[str, float] = {}
    device = torch.cuda.memory_stats()
    counters["device_mallocs"] = device.get("num_device_alloc", 0)
    counters["device_alloc_retries"] = device.get("num_alloc_retries", 0)
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    try:  # a diagnostic: a torch without these statistics must not stop the benchmark
        host = host_stats() if host_stats is not None else None
    except RuntimeError:
        host = None
    if host is not None:
        counters["pinned_allocs"] = host.get("num_host_alloc", 0)
        counters["pinned_alloc_ms"] = host.get("host_alloc_time.total", 0) / 1e3
    return counters


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: round(after[key] - before.get(key, 0), 3) for key in after}


HEADER = ("benchmark", "device", "commit", "time_utc")


def write_result(
    name: str, payload: dict[str, Any], *, device: torch.device, out_dir: Path = RESULTS
) -> Path:
    """`<out_dir>/<name>.json`, headed by benchmark name, device, commit and time."""
    return write_record(out_dir / f"{name}.json", name, payload, device=device)


def write_record(path: Path, name: str, payload: dict[str, Any], *, device: torch.device) -> Path:
    """`path`, headed by benchmark `name`, device, commit and time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "device": device_info(device), **run_stamp(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def run_stamp() -> dict[str, str]:
    """The commit and the time of this run."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"commit": git_commit(), "time_utc": now}


def read_record(path: Path) -> dict[str, Any]:
    """An earlier result file's fields without its header ({} when there is none): the parts of a
    benchmark that run in separate processes (separate device calls) merge into one file."""
    if not path.is_file():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in HEADER}


def bar_chart(
    path: Path,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    ylabel: str,
    title: str,
    reference: float | None = None,
    reference_label: str = "roofline",
) -> Path | None:
    """A bar chart with an optional horizontal reference line; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(labels) + 2), 4))
    ax.bar(list(labels), list(values), color="#4C72B0")
    if reference is not None:
        ax.axhline(reference, color="#C44E52", linestyle="--", label=reference_label)
        ax.legend()
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """A plain fixed-width table on stdout: the summary a person reads at the end of a run."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "-" if value is None else str(value)


def graph_us(call: Callable[[int], object], calls: int, replays: int = 15) -> float:
    """µs per call of call(i), i < calls, captured back to back into one graph; median of replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def call_timer(device: torch.device) -> Callable[[Callable[[int], object], int], float]:
    """µs per call: CUDA-graph replays on the GPU (graph_us), one pass of the wall clock elsewhere (a
    smoke run, whose times mean nothing)."""
    if device.type == "cuda":
        return graph_us

    def wall(call: Callable[[int], object], calls: int) -> float:
        start = time.perf_counter()
        for i in range(calls):
            call(i)
        return (time.perf_counter() - start) / calls * 1e6

    return wall
