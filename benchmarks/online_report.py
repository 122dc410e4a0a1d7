"""Results of `tandem bench online`: the JSON (device, commit, config, points) and the latency-vs-load PNG."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

from tandem.benchmarks import common


def write(result: dict[str, Any], results_dir: Path, tag: str, *, plot: bool = True) -> Path:
    """Write online-<tag>.json (and online-<tag>.png when there are points to draw); return the JSON path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path = results_dir / f"online-{tag}.json"
    png_path = json_path.with_suffix(".png")
    document = {
        "benchmark": "online_serving",
        "tag": tag,
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(),
        "commit": common.git_commit(),  # "<hash>-dirty" when tracked files differed from it
        "config": config_of(result["args"]),
        "mode": result["mode"],
        "points": result["points"],
        "serve_overhead": result["serve_overhead"],
        "plot": None,
    }
    if plot and result["points"] and plot_latency(result["points"], result["mode"], png_path, tag):
        document["plot"] = png_path.name
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    return json_path


def config_of(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """Every flag, JSON-safe (paths as strings, an infinite rate as "inf")."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: _json_safe(v) for k, v in values.items()}


def _json_safe(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def device_info() -> dict[str, Any]:
    """The machine the client ran on (the server's may differ): its GPU if torch sees one, its CPU."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"host": platform.node(), "cpu": _cpu_model(), **common.device_info(device)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plot_latency(points: list[dict[str, Any]], mode: str, path: Path, title: str) -> bool:
    """p50/p99 TTFT and TPOT against offered load. False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on benchmark hosts
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the PNG (pip install matplotlib)")
        return False
    loads = _load_values([p[mode] for p in points])
    xlabel = "offered load (req/s)" if mode == "rate" else "concurrency (clients)"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, metric, label in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ys = [p[metric][pct] if p[metric][pct] is not None else math.nan for p in points]
            ax.plot(loads, ys, style, label=f"{label} {pct}")
        if min(loads) > 0 and max(loads) / min(loads) >= 8:
            ax.set_xscale("log")  # sweeps are usually geometric (1, 2, 4, ...)
        ax.set_xticks(loads, [_label(p[mode]) for p in points])  # labelled as swept; "inf" included
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"tandem online: {title}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _load_values(values: list[Any]) -> list[float]:
    # An infinite rate ("inf" in JSON) is drawn a step past the largest finite load.
    finite = [float(v) for v in values if v != "inf" and not math.isinf(float(v))]
    beyond = 2.0 * max(finite) if finite else 1.0
    return [beyond if v == "inf" or math.isinf(float(v)) else float(v) for v in values]


def _label(load: Any) -> str:
    return load if isinstance(load, str) else f"{load:g}"


def point_line(mode: str, load: float, point: dict[str, Any]) -> str:
    """One console line per sweep point."""
    ttft, tpot = point["ttft_ms"], point["tpot_ms"]
    return (
        f"{mode}={load:g}: {point['completed']} ok, {point['failed']} failed, {point['not_sent']} unsent | "
        f"{point['request_throughput']:.2f} req/s, {point['output_throughput']:.1f} tok/s, "
        f"goodput {point['goodput']:.2f} req/s | TTFT p50/p99 {_ms(ttft['p50'])}/{_ms(ttft['p99'])} | "
        f"TPOT p50/p99 {_ms(tpot['p50'])}/{_ms(tpot['p99'])} ms"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
