#!/usr/bin/env bash
# Before/after A/B of two source trees in one device run: offline throughput (benchmarks/offline.py, all-on)
# and the batch-1 decode step (benchmarks/decode.py --quick, graphs), alternating A B A B so that drift of
# the host hits both alike. Each tree is imported as `tandem` through its own PYTHONPATH shim.
#   BEFORE_COMMIT=f03d165 AFTER_COMMIT=<hash> bash scripts/ab_trees.sh decode|offline BEFORE_TREE [AFTER_TREE=.] [OUT=/tmp/ab]
# (the commits only label the result files: GPU hosts have no .git)
# BEFORE_TREE is a plain copy of the other commit, e.g. made on the host that has git:
#   git archive <commit> | tar -x -C <dir>      (the GPU host needs no git)
# Writes OUT/<phase>-summary.json: per tree the runs' figures, and after/before ratios of the medians.
set -euo pipefail
PHASE=${1:?phase: decode or offline}; BEFORE=$(cd "${2:?before tree}" && pwd); AFTER=$(cd "${3:-.}" && pwd)
OUT=${4:-${OUT:-/tmp/ab}}; REPEATS=${REPEATS:-2}
mkdir -p "$OUT"
shim() {  # tree -> a directory whose `tandem` is that tree
  local dir; dir=$(mktemp -d); ln -s "$1" "$dir/tandem"; echo "$dir"
}
declare -A PATHS=([before]=$(shim "$BEFORE") [after]=$(shim "$AFTER"))
for i in $(seq 1 "$REPEATS"); do
  for side in before after; do
    dest="$OUT/$PHASE-$side-$i"; mkdir -p "$dest"
    tree=$([ "$side" = before ] && echo "$BEFORE" || echo "$AFTER")
    commit=$([ "$side" = before ] && echo "${BEFORE_COMMIT:-before}" || echo "${AFTER_COMMIT:-after}")
    if [ "$PHASE" = decode ]; then
      (cd "$tree" && TANDEM_COMMIT=$commit PYTHONPATH=${PATHS[$side]} python3 benchmarks/decode.py --quick --batches 1 --out-dir "$dest") \
        > "$dest.log" 2>&1 || echo "== $side $i failed: see $dest.log"
    else
      (cd "$tree" && TANDEM_COMMIT=$commit PYTHONPATH=${PATHS[$side]} python3 benchmarks/offline.py --ablations all-on --out-dir "$dest") \
        > "$dest.log" 2>&1 || echo "== $side $i failed: see $dest.log"
    fi
  done
done
python3 - "$OUT" "$PHASE" "$REPEATS" <<'PY'
import json, statistics, sys
from pathlib import Path
out, phase, repeats = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
summary = {}
for side in ("before", "after"):
    values = []
    for i in range(1, repeats + 1):
        for path in (out / f"{phase}-{side}-{i}").glob("*.json"):
            record = json.loads(path.read_text())
            summary.setdefault(f"{side}_commit", record.get("commit"))
            summary.setdefault("device", record.get("device"))
            if phase == "decode":
                values += [r["graph_ms"] for r in record["results"] if r["batch"] == 1]
            else:
                values.append(record["runs"]["all-on"]["output_tok_per_s"])
    key = "decode_b1_graph_ms" if phase == "decode" else "offline_output_tok_s"
    summary[f"{side}_{key}"] = values
    summary[f"{side}_{key}_median"] = statistics.median(values) if values else None
b, a = summary.get(f"before_{key}_median"), summary.get(f"after_{key}_median")
summary["after_over_before"] = a / b if a and b else None
(out / f"{phase}-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
