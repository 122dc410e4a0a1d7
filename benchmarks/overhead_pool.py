"""Pool the serve-overhead pairs of several runs on one host: the median over every pair, with a
bootstrap interval that resamples whole runs first, then pairs within each.

One run's median moves by a millisecond or more from one deployment to the next on a lent GPU host
(where the processes land, what else the host runs); within a run, 200 pairs pin it to ~0.1 ms. So a
single run says little about the host's typical overhead, and resampling pairs alone would understate
the spread: the interval here treats each run as one draw of the host's state.

    python benchmarks/overhead_pool.py benchmarks/results/online-h200-fi-r*.json --tag h200-fi-pooled
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from tandem.benchmarks.online import DEFAULT_RESULTS_DIR


def pool(runs: dict[str, list[float]], *, draws: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Pooled median of every run's pair differences (ms) and its 95% run-then-pair bootstrap interval."""
    runs = {name: diffs for name, diffs in runs.items() if diffs}
    if not runs:
        raise ValueError("no run has pair differences (pair_differences_ms)")
    everything = [d for diffs in runs.values() for d in diffs]
    rng = random.Random(seed)
    names = sorted(runs)
    medians = []
    for _ in range(draws):
        sample: list[float] = []
        for name in rng.choices(names, k=len(names)):
            diffs = runs[name]
            sample.extend(rng.choices(diffs, k=len(diffs)))
        medians.append(statistics.median(sample))
    medians.sort()
    return {
        "runs": len(runs),
        "pairs": len(everything),
        "per_run_paired_p50_ms": {name: round(statistics.median(runs[name]), 3) for name in names},
        "pooled_paired_p50_ms": round(statistics.median(everything), 3),
        "pooled_ci95_ms": [round(medians[int(0.025 * draws)], 3), round(medians[int(0.975 * draws) - 1], 3)],
        "bootstrap": f"{draws} draws: runs with replacement, then pairs with replacement within each",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="online-<tag>.json files with serve_overhead")
    p.add_argument("--tag", required=True, help="Writes online-<tag>.json.")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR)
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {}
    sources = []
    for path in args.files:
        doc = json.loads(path.read_text())
        runs[path.name] = list(doc["serve_overhead"].get("pair_differences_ms") or [])
        sources.append({"file": path.name, "commit": doc.get("commit"), "device": doc.get("device")})
    result = {"benchmark": f"online-{args.tag}", "sources": sources, **pool(runs)}
    out = args.results_dir / f"online-{args.tag}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sources"}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
