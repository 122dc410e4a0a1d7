"""Prefix-cache-aware routing against Serve's default router, in one run over real HTTP.

It starts Ray and Serve itself (the ingress mode is a setting of Ray's processes, so it must be in the
environment before Ray starts), then deploys the app once per phase and sends each the same workload:
`--prefixes` shared prefixes of `--prefix-tokens` tokens, `--requests` requests interleaved over them
(request i uses prefix i mod P), each with its own short question, `--concurrency` at a time, streamed
with `include_usage`. Phases:

- `single`: one replica serving everything (the reference for the cache hits);
- `routed`: `--replicas` replicas with prefix routing;
- `default`: the same replicas with Serve's default (power-of-two) router.

Per phase it reports the sum of `usage.prompt_tokens_details.cached_tokens`, the hit ratio (cached over
prompt tokens), TTFT p50/p99 (first content chunk), throughput, and the replicas' own prefix-cache hit
counters (which must equal the usage sum: every request went to this phase's fresh replicas). A short
probe before the workload measures the routing hop's TTFT cost: `--probe-requests` sequential requests
with a short prompt.

    # CPU, the tiny model (what tests/e2e/test_prefix_routing.py runs)
    python -m tandem.benchmarks.prefix_routing --preset cpu --out /tmp/prefix-routing-cpu.json
    # one H200: two replicas of the Qwen3-0.6B shape, each with half the KV memory
    python -m tandem.benchmarks.prefix_routing --preset h200 \\
        --out benchmarks/results/prefix-routing-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

APP = "tandem-prefix-routing"
PHASES = ("single", "routed", "default")
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "prefixes": 8, "prefix_tokens": 200, "requests": 192, "concurrency": 8, "max_tokens": 2,
        "replicas": 2, "phases": "single,routed,default", "probe_requests": 20, "kv_tokens": 1200,
        "drain_s": 3.0,
    },
    "h200": {
        "prefixes": 16, "prefix_tokens": 1000, "requests": 512, "concurrency": 64, "max_tokens": 64,
        "replicas": 2, "phases": "routed,default", "probe_requests": 50, "shape": "qwen3-0.6b",
    },
    # The same workload where the prefixes (~16.6k tokens) fit in two replicas' KV but not in one's.
    "h200-kv-bound": {
        "prefixes": 16, "prefix_tokens": 1000, "requests": 512, "concurrency": 64, "max_tokens": 64,
        "replicas": 2, "phases": "routed,default", "probe_requests": 50, "shape": "qwen3-0.6b",
        "kv_tokens": 12000,
    },
}  # fmt: skip
_WORDS = [
    *["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school"],
    *["state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week"],
    *["company", "system", "program", "question", "work", "government", "number", "night", "point", "home"],
    *["water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book"],
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy")
    p.add_argument("--prefixes", type=int)
    p.add_argument("--prefix-tokens", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--replicas", type=int)
    p.add_argument("--phases", help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--probe-requests", type=int)
    p.add_argument("--shape", help="benchmarks/shapes.py model shape with random weights (GPU presets)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        help="KV tokens per replica (the single replica gets all replicas' worth); GPU default: half of "
        "what one engine would get at mem_fraction 0.85",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        help="How long Serve keeps a replaced replica for HAProxy to drop (Ray's default 30 s); a short "
        "one makes the phase changes quick on a test box",
    )
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    # Before anything imports Ray Serve: its processes (and this driver's `build_app`) read the mode at
    # start-up.
    from tandem.deploy.routing.ingress_mode import ray_environment

    os.environ.update(ray_environment(args.ingress))
    if args.drain_s is not None:
        os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(args.drain_s)
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result["summary"], indent=2, sort_keys=True))
    return 0 if all(not p["errors"] for p in result["phases"].values()) else 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from tandem.benchmarks.common import git_commit

    on_gpu = args.shape is not None
    model_dir, page = _model(args) if on_gpu else (None, 4)
    http_port = _free_port()
    ray_init: dict[str, Any] = {"num_cpus": 16, "include_dashboard": False}
    if on_gpu:
        # Two engines on one GPU: each replica reserves "a GPU" of two logical ones, and Ray leaves
        # CUDA_VISIBLE_DEVICES alone so both open the one physical device.
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        ray_init["num_gpus"] = args.replicas
    ray.init(**ray_init)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        prompts = _prompts(args, model_dir)
        phases: dict[str, Any] = {}
        for phase in args.phases.split(","):
            app_args = _app_args(args, phase, model_dir, page)
            phases[phase] = await _phase(args, phase, app_args, prompts, f"http://127.0.0.1:{http_port}")
            print(f"{phase}: {json.dumps(_brief(phases[phase]))}", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = _summary(phases)
    return summary | {
        "benchmark": "prefix_routing",
        "device": _device_name(on_gpu),
        "commit": git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "phases": phases,
        "summary": summary,
    }


def _model(args: argparse.Namespace) -> tuple[str, int]:
    """The random-weight model of `--shape`, and its page size; resolves `--kv-tokens` from free memory."""
    import torch

    from tandem.benchmarks.shapes import SHAPES, write_random_model
    from tandem.engine.tiny.tokenizer import VOCAB_SIZE

    family, shape = SHAPES[args.shape]
    cache = Path(os.environ.get("TANDEM_BENCH_MODELS", Path.home() / ".cache" / "tandem" / "bench-models"))
    # A vocabulary equal to the tiny tokenizer's, so every token is text and the first content chunk
    # comes with the first token (a wide head would make most tokens textless: TTFT would be wrong).
    shape = {**shape, "vocab_size": VOCAB_SIZE}
    path = cache / f"{args.shape}-v{VOCAB_SIZE}"
    path = write_random_model(path, family, device=torch.device("cuda"), **shape)
    page = 16
    kv_tokens = args.kv_tokens
    if kv_tokens is None:  # half of one engine's pool at mem_fraction 0.85, weights (bf16) taken out
        free, total = torch.cuda.mem_get_info()
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        token_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
        kv_tokens = int((free - 0.15 * total - weights) / token_bytes / 2)
    args.kv_tokens = kv_tokens
    return str(path), page


def _app_args(args: argparse.Namespace, phase: str, model: str | None, page: int) -> dict[str, Any]:
    """One phase's app. Each replica has `--kv-tokens` of KV; the single replica has all of theirs."""
    kv_tokens = args.kv_tokens * (args.replicas if phase == "single" else 1)
    engine = {"page_size": page, "num_pages": max(64, kv_tokens // page)}
    base: dict[str, Any] = {"engine": engine, "max_ongoing_requests": max(64, args.concurrency)}
    if model is not None:
        base |= {"model": model, "device": "cuda"}
    if phase == "single":
        return base | {"num_replicas": 1}
    return base | {"num_replicas": args.replicas, "prefix_routing": phase == "routed"}


def _prompts(args: argparse.Namespace, model_dir: str | None) -> list[str]:
    from transformers import AutoTokenizer

    from tandem.engine.tiny import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir or default_model_dir())
    rng = random.Random(0)
    prefixes = []
    for p in range(args.prefixes):
        words = [f"System prompt {p}:"]
        while len(tokenizer.encode(" ".join(words))) < args.prefix_tokens:
            words.extend(rng.choice(_WORDS) for _ in range(8))
        prefixes.append(" ".join(words))
    return [
        f"{prefixes[i % args.prefixes]} Question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(6))
        for i in range(args.requests)
    ]


async def _phase(
    args: argparse.Namespace, phase: str, app_args: dict[str, Any], prompts: list[str], base_url: str
) -> dict[str, Any]:
    import aiohttp
    from ray import serve

    from tandem.deploy.app import build_app

    # A fresh app per phase: its replicas start with empty caches, all at once (an update in place would
    # roll them one by one).
    if APP in serve.status().applications:
        serve.delete(APP)
    deploy_start = time.perf_counter()
    serve.run(build_app(app_args), name=APP, route_prefix="/")
    deploy_s = time.perf_counter() - deploy_start
    handle = serve.get_app_handle(APP)
    async with aiohttp.ClientSession(base_url=base_url, timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _wait_ready(http)
        before = await handle.stats.remote()
        probe = [
            await _request(http, f"probe {i}: " + " ".join(_WORDS[:10]), 1)
            for i in range(args.probe_requests)
        ]
        probe_hits = sum(r["cached_tokens"] for r in probe)
        semaphore = asyncio.Semaphore(args.concurrency)

        async def one(prompt: str) -> dict[str, Any]:
            async with semaphore:
                return await _request(http, prompt, args.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        after = await handle.stats.remote()
    ok = [r for r in results if r["error"] is None]
    cached, prompt_tokens = sum(r["cached_tokens"] for r in ok), sum(r["prompt_tokens"] for r in ok)
    return {
        "app_args": app_args,
        "deploy_s": deploy_s,
        "num_replicas": after.get("num_replicas"),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "hit_ratio": cached / prompt_tokens if prompt_tokens else 0.0,
        # The replicas' own counter over the probe and the workload: equal to the usage sums unless a
        # request went to a replica of another phase.
        "replica_hit_tokens": after.get("prefix_cache_hit_tokens", 0)
        - before.get("prefix_cache_hit_tokens", 0),
        "usage_hit_tokens": cached + probe_hits,
        "per_replica_prefix_cache": after.get("per_replica_prefix_cache"),
        "ttft_ms": _percentiles([r["ttft_s"] * 1e3 for r in ok]),
        "probe_ttft_ms": _percentiles([r["ttft_s"] * 1e3 for r in probe if r["error"] is None]),
        "requests_per_s": len(ok) / seconds,
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / seconds,
        "errors": [r["error"] for r in results + probe if r["error"] is not None][:5],
    }


async def _wait_ready(http: Any, timeout_s: float = 120.0) -> None:
    """Until the app answers through the ingress, then a moment for HAProxy to take in every replica."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get("/v1/models") as response:
                if response.status == 200:
                    await asyncio.sleep(5.0)
                    return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("the app did not answer /v1/models")


async def _request(http: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"ttft_s": None, "cached_tokens": 0, "prompt_tokens": 0, "completion_tokens": 0}
    start = time.perf_counter()
    try:
        async with http.post("/v1/completions", json=body) as response:
            if response.status != 200:
                return out | {"error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return out | {"error": str(chunk["error"])[:200]}
                if out["ttft_s"] is None and chunk.get("choices"):
                    # The first chunk of output; text may lag a token (a partial UTF-8 character).
                    out["ttft_s"] = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    out["prompt_tokens"] = usage["prompt_tokens"]
                    out["completion_tokens"] = usage["completion_tokens"]
                    out["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
    except (OSError, asyncio.TimeoutError) as exc:
        return out | {"error": f"{type(exc).__name__}: {exc}"}
    if out["ttft_s"] is None:
        return out | {"error": "no output chunk"}
    return out | {"error": None}


def _hits(stats: dict[str, Any]) -> int:
    return int(stats.get("prefix_cache_hit_tokens", 0))


def _percentiles(values: list[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def _summary(phases: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, phase in phases.items():
        summary[f"hit_ratio_{name}"] = phase["hit_ratio"]
        summary[f"cached_tokens_{name}"] = phase["cached_tokens"]
        summary[f"ttft_p50_ms_{name}"] = phase["ttft_ms"]["p50"]
        summary[f"ttft_p99_ms_{name}"] = phase["ttft_ms"]["p99"]
        summary[f"probe_ttft_p50_ms_{name}"] = phase["probe_ttft_ms"]["p50"]
        summary[f"requests_per_s_{name}"] = phase["requests_per_s"]
    return summary


def _brief(phase: dict[str, Any]) -> dict[str, Any]:
    keys = ("num_replicas", "cached_tokens", "hit_ratio", "replica_hit_tokens", "usage_hit_tokens", "errors")
    return {k: phase[k] for k in keys} | {"ttft_p50_ms": phase["ttft_ms"]["p50"]}


def _device_name(on_gpu: bool) -> str:
    if on_gpu:
        import torch

        return str(torch.cuda.get_device_name())
    return f"cpu ({os.cpu_count()} cores)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    raise SystemExit(main())
