#!/usr/bin/env bash
# A GPU host session in a few commands (device time is scarce). Each phase sends its logs and results to
# OUT and ends with a short summary, so the caller sees the figures even when a step fails loudly.
#   source .device/gpu-env.sh && benchmarks/gpu_session.sh tests|offline|latency|hf|serve [OUT]
# About: tests 6 min (kernel builds included), offline 4, latency 6, hf 5, serve 4 (per ingress mode).
set -uo pipefail
PHASE=${1:?phase: tests, offline, latency, hf or serve}; OUT=${2:-${OUT:-/tmp/gpu-session}}
mkdir -p "$OUT"
export TANDEM_COMMIT=${TANDEM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
run() {  # name, timeout in s, command...: log to OUT/name.log, say how it ended
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
}
case $PHASE in
  tests)
    run prebuild 300 python3 benchmarks/prebuild_kernels.py --softcap
    run gpu-tests 420 python3 -m pytest tests/gpu -p no:warnings -rfE \
      --deselect tests/gpu/test_replica_serve_gpu.py
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/gpu-tests.log" | tail -15 ;;
  offline)
    run offline 420 python3 benchmarks/offline.py --out-dir "$OUT"
    run short-prefill 120 python3 benchmarks/offline.py --num-seqs 64 --min-input 128 --max-input 128 \
      --min-output 1 --max-output 1 --chunk-size 2048 --ablations all-on,no-piecewise --tag short-prefill \
      --out-dir "$OUT"
    tail -10 "$OUT/offline.log"; tail -3 "$OUT/short-prefill.log" ;;
  latency)
    run decode 360 python3 benchmarks/decode.py --out-dir "$OUT"
    run window 200 python3 benchmarks/window.py --quick --out-dir "$OUT"
    tail -5 "$OUT/decode.log"; tail -5 "$OUT/window.log" ;;
  hf)
    run hf-peer 560 python3 benchmarks/offline.py --ablations all-on --hf-peer --tag hf-peer --out-dir "$OUT"
    tail -4 "$OUT/hf-peer.log" ;;
  serve)
    for mode in proxy haproxy; do
      run "serve-$mode" 280 bash benchmarks/serve_overhead.sh cuda "h200-tiny-$mode" "$mode"
      cp /tmp/tandem-serve.log "$OUT/tandem-serve-$mode.log" 2>/dev/null
      cp "benchmarks/results/online-h200-tiny-$mode".* "$OUT/" 2>/dev/null
      grep -h "serve overhead" "$OUT/serve-$mode.log"
    done ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
