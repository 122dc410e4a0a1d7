"""One table from the GPU benchmarks' result files: `python benchmarks/summary.py [FILES...]`
(default: the offline, decode and window results in benchmarks/results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tandem.benchmarks.common import RESULTS, print_table


def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    name, rows = record["benchmark"], []
    if name.startswith("offline"):
        for setting, run in record["runs"].items():
            rows.append(
                {
                    "benchmark": name,
                    "case": setting,
                    "value": run["output_tok_per_s"],
                    "unit": "tok/s",
                    "% roofline": run["percent_of_roofline"],
                }
            )
    elif name.startswith("decode"):
        for r in record["results"]:
            for mode in ("graph", "eager"):
                rows.append(
                    {
                        "benchmark": name,
                        "case": f"bs{r['batch']} {mode}",
                        "value": r[f"{mode}_ms"],
                        "unit": "ms/step",
                        "% roofline": r[f"{mode}_pct_of_floor"],
                    }
                )
    elif name.startswith("window"):
        for r in record["results"]:
            case = f"{r['context']} ctx {'evict' if r['eviction'] else 'no-evict'}"
            rows.append(
                {
                    "benchmark": name,
                    "case": case,
                    "value": r["ms_per_step"],
                    "unit": "ms/step",
                    "% roofline": r["pct_of_floor"],
                }
            )
    return rows


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        p for p in RESULTS.glob("*.json") if p.name.startswith(("offline", "decode", "window"))
    )
    rows = []
    for path in paths:
        record = json.loads(path.read_text())
        rows += rows_of(record)
        print(f"{path.name}: {record['device'].get('gpu', '?')}, commit {record['commit']}")
    print_table(rows, ["benchmark", "case", "value", "unit", "% roofline"])


if __name__ == "__main__":
    main()
