#!/usr/bin/env bash
# Online serving on one host: start `tandem serve`, sweep a few concurrencies, and measure what Ray
# Serve adds to TTFT (HTTP minus in-process LLMReplica.generate). Writes benchmarks/results/online-<tag>.json.
#   usage: scripts/serve_overhead.sh [cpu|cuda] [TAG] [proxy|haproxy]
# With cuda, the in-process replica needs a GPU of its own beside the server's: on a one-GPU host use
# `benchmarks/online_local_overhead.py --device cuda`, which measures the two sides one after the other.
set -uo pipefail
DEVICE=${1:-cuda}; TAG=${2:-tiny-$DEVICE}; INGRESS=${3:-proxy}
MODEL=$(python3 -c "from tandem.engine.tiny import default_model_dir; print(default_model_dir())")
ENGINE='{"num_pages": 8192}'  # the tiny model's pool; leaves the GPU to the in-process replica too
tandem serve --model "$MODEL" --served-model-name tandem-tiny --device "$DEVICE" --port 8000 \
  --ingress "$INGRESS" > /tmp/tandem-serve.log 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; sleep 3; kill -9 $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 240); do  # bounded wait for the app to answer
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=2)" \
    2>/dev/null && break
  sleep 1
done
python3 benchmarks/online.py --base-url http://127.0.0.1:8000 --model tandem-tiny --concurrency 1,8,32 \
  --num-prompts 64 --input-len 128 --output-len 32 --serve-overhead --overhead-device "$DEVICE" \
  --overhead-model "$MODEL" --overhead-engine "$ENGINE" --overhead-ray-address auto --tag "$TAG" \
  --max-duration-s 240 || tail -20 /tmp/tandem-serve.log
