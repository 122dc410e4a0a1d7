#!/usr/bin/env bash
# Several serve-overhead runs on one GPU host, each a fresh deployment (the figure moves between
# deployments more than within one), then their pairs pooled (overhead_pool.py).
#   source .device/gpu-env.sh && scripts/serve_runs.sh RUNS TAG [OUT]
# Environment: REQUESTS (pairs per run, 200), SERVE_MODEL (flashinfer or tiny), ENGINE (JSON engine
# options for both engines), DEVICE (cuda; cpu to try the script on a development box).
# Between runs, any process still holding the GPU is ended, so that a run stopped by its timeout
# cannot leave a rank holding GPU memory into the next run.
set -uo pipefail
RUNS=${1:?runs}; TAG=${2:?tag}; OUT=${3:-${OUT:-/tmp/gpu-session}}
mkdir -p "$OUT"
# A flashinfer cache restored from pack_fi_cache.py has emptied objects: a module that ninja relinks
# on first use loses its functions ("Module has no function 'rmsnorm'", seen on an H200). The prebuild
# rebuilds such a module whole, and is a no-op when everything is up to date.
DEVICE=${DEVICE:-cuda}
[ "$DEVICE" = cuda ] && [ "${SERVE_MODEL:-flashinfer}" = flashinfer ] && python3 scripts/prebuild_kernels.py > "$OUT/prebuild.log" 2>&1
for r in $(seq 1 "$RUNS"); do
  limit=$([ "$r" = 1 ] && echo 300 || echo 170)  # the first run builds the Triton kernels
  timeout "$limit" python3 benchmarks/online_local_overhead.py --device "$DEVICE" --ingress haproxy --direct \
    --num-cpus "${NUM_CPUS:-16}" --requests "${REQUESTS:-200}" --model "${SERVE_MODEL:-flashinfer}" \
    --engine "${ENGINE:-{\}}" \
    --tag "$TAG-r$r" --results-dir "$OUT" > "$OUT/serve-r$r.log" 2>&1
  echo "== r$r: exit $? at $(date +%T)"
  grep -h "own port\|serve overhead" "$OUT/serve-r$r.log"
  if [ ! -f "$OUT/online-$TAG-r$r.json" ]; then  # say why the replica failed
    grep -h -m1 -A40 "Traceback" /tmp/ray/session_latest/logs/serve/replica_*.log 2>/dev/null | head -45
  fi
  ray stop --force > /dev/null 2>&1
  nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
  sleep 3
done
python3 benchmarks/overhead_pool.py "$OUT"/online-"$TAG"-r*.json --tag "$TAG-pooled" --results-dir "$OUT" | tail -14
