"""`--serve-overhead` on one small machine: start a private Ray, deploy the app, measure, tear down.

`benchmarks/serve_overhead.sh` runs `tandem serve`, whose local Ray gets as many CPUs as the host has
cores; on a 2-core box the app's replica and rank take both, and the benchmark's in-process replica
could not place its rank. This driver starts Ray with enough logical CPUs for both (as the e2e tests
do), serves the embedded tiny model, and runs `online.py --serve-overhead` against it, adding two
probes that split the overhead: the /v1/models round trip (proxy and FastAPI, no model) and the time to
first token through the app's Python handle (no proxy, no HTTP).

    python benchmarks/online_local_overhead.py --tag cpu-2core --requests 40
    python benchmarks/online_local_overhead.py --device cuda --ingress haproxy --tag h200-tiny-haproxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tandem.benchmarks import online, online_report, serve_overhead

APP = "tandem"
MODEL = "tandem-tiny"
# --model flashinfer: about the tiny model's size with a head_dim flashinfer serves, so on a GPU both
# engines run the GPU path (flashinfer, decode and piecewise graphs). The embedded tiny model's head_dim
# 16 takes the torch backend there, a per-row Python loop of ~3 ms a step that dominates its TTFT.
# head_dim 128 and Qwen3-0.6B's 2:1 grouping: the flashinfer module prebuild_kernels.py caches.
FLASHINFER_TINY: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "intermediate_size": 512,
}


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _probes(base_url: str, requests: int) -> dict[str, Any]:
    import aiohttp
    from ray import serve

    models: list[float] = []
    async with aiohttp.ClientSession(trust_env=False) as client:
        for i in range(requests + 3):  # the first 3 warm up
            start = time.perf_counter()
            async with client.get(base_url + "/v1/models") as reply:
                await reply.read()
            if i >= 3:
                models.append((time.perf_counter() - start) * 1e3)
    handle = serve.get_app_handle(APP).options(stream=True)
    ttft: list[float] = []
    for i in range(requests + 3):
        body = {
            "model": MODEL,
            "prompt": [(i * 7 + k) % 400 + 5 for k in range(32)],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        start, first = time.perf_counter(), None
        async for chunk in handle.completions.remote(body):
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = (time.perf_counter() - start) * 1e3
        if i >= 3 and first is not None:
            ttft.append(first)
    return {
        "models_round_trip_ms_p50": round(statistics.median(models), 3),
        "handle_ttft_ms_p50": round(statistics.median(ttft), 3) if ttft else None,
    }


def _replica_port(ports: range = range(30000, 30100)) -> int | None:
    """The one replica's own HTTP port in HAProxy mode (Serve's direct ingress takes it from 30000 up),
    found by its `/-/routes` answer naming this app; None if no port answers so."""
    import urllib.request

    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/routes", timeout=0.5) as reply:
                if APP in reply.read().decode(errors="replace"):
                    return port
        except OSError:  # refused, timed out, or an HTTP error (URLError is an OSError)
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="cpu-local", help="Writes online-<tag>.json.")
    p.add_argument("--requests", type=int, default=40, help="Sequential pairs (and probe requests).")
    p.add_argument("--num-cpus", type=int, default=8, help="Logical CPUs of the private Ray.")
    p.add_argument("--results-dir", type=Path, default=online.DEFAULT_RESULTS_DIR)
    p.add_argument("--ingress", choices=["proxy", "haproxy"], default="proxy", help="As `tandem serve`.")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="Where both engines run (the app's and the in-process one).",
    )
    p.add_argument(
        "--order",
        choices=["pairs", "sides"],
        default=None,
        help="pairs (default): HTTP and in-process requests alternate, so drift on the host hits both "
        "sides alike; on cuda each engine gets a GPU of its own when the host has two, else both share "
        "the one GPU (see --gpu-share). sides: the in-process side runs first, on its own, and the app "
        "is deployed after it.",
    )
    p.add_argument(
        "--gpu-share",
        type=float,
        default=0.3,
        help="With --device cuda, pairs and one GPU: the GPU memory share of each engine. mem_fraction caps "
        "all the device's use, so the app (deployed first) gets this and the in-process engine twice "
        "this. Ray is told of two GPUs and leaves CUDA_VISIBLE_DEVICES alone, so both ranks land on "
        "device 0.",
    )
    p.add_argument(
        "--one-gpu",
        action="store_true",
        help="With --device cuda and pairs: both engines on GPU 0 even when the host has more. Two "
        "processes on one GPU time-slice it, which may add to either side's TTFT.",
    )
    p.add_argument(
        "--model",
        choices=["tiny", "flashinfer"],
        default="tiny",
        help="tiny: the embedded tiny model. flashinfer: a random Qwen3-shaped model of about its size "
        "with head_dim 128 (the tiny tokenizer), written under --model-dir, served on both sides.",
    )
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench/flashinfer-tiny"))
    p.add_argument(
        "--engine",
        type=online._json_object,  # a clear argparse error for anything but a JSON object
        default={},
        help="Engine options for both engines, as JSON (e.g. '{\"cuda_graph_max_bs\": 8}': fewer graphs "
        "to capture, a shorter start).",
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="With --ingress haproxy: also time each pair at the replica's own port (HAProxy's share).",
    )
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from tandem.deploy.app import build_app
    from tandem.deploy.routing.ingress_mode import ray_environment

    for key, value in ray_environment(args.ingress).items():  # as `tandem serve` does
        os.environ.setdefault(key, value)
    order = args.order or "pairs"
    share_gpu = args.device == "cuda" and order == "pairs" and (args.one_gpu or _visible_gpus() < 2)
    engine: dict[str, Any] = {**args.engine, **({"mem_fraction": args.gpu_share} if share_gpu else {})}
    local_engine = {**args.engine, **({"mem_fraction": 2 * args.gpu_share} if share_gpu else {})}
    num_gpus = None
    if share_gpu:
        # One physical GPU holds both engines (a tiny model each): Ray counts two and sets no
        # CUDA_VISIBLE_DEVICES, so each rank's "cuda" is device 0.
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        num_gpus = 2
    model_dir = None
    if args.model == "flashinfer":
        import torch

        from tandem.benchmarks.shapes import write_random_model

        model_dir = str(
            write_random_model(args.model_dir, "qwen3", device=torch.device("cpu"), **FLASHINFER_TINY)
        )
    shared = [
        "--model",
        MODEL,
        "--serve-overhead",
        "--overhead-device",
        args.device,
        "--overhead-engine",
        json.dumps(local_engine),
        *(["--overhead-model", model_dir] if model_dir else []),
    ]
    overhead_args = online.build_parser().parse_args(
        ["--base-url", "http://unused", *shared, "--overhead-requests", str(args.requests)]
    )
    ray.init(num_cpus=args.num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    try:
        local = None
        if order == "sides":
            local = asyncio.run(serve_overhead.measure_inprocess(overhead_args))
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = {"served_model_name": MODEL, "device": args.device, "engine": engine, "model": model_dir}
        serve.run(build_app(app_args), name=APP, route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        probes = asyncio.run(_probes(base_url, args.requests))
        print(f"probes: {probes}", flush=True)
        if local is not None:
            http = asyncio.run(serve_overhead.measure_http(base_url + "/v1/completions", overhead_args))
            summary = serve_overhead.overhead_summary(
                http, local, overhead_args, order="in-process, then HTTP"
            )
            sides: dict[str, Any] = {
                "mode": None,
                "points": [],
                "serve_overhead": summary,
                "args": overhead_args,
            }
            online_report.write(sides, args.results_dir, args.tag, plot=False)
        else:
            direct: list[str] = []
            if args.direct and args.ingress == "haproxy":
                port = _replica_port()
                print(f"the replica's own port: {port}", flush=True)
                if port is not None:
                    direct = ["--overhead-direct-url", f"http://127.0.0.1:{port}/v1/completions"]
            online.main(
                ["--base-url", base_url, *shared, *direct]
                + ["--overhead-requests", str(args.requests), "--tag", args.tag, "--no-plot"]
                + ["--results-dir", str(args.results_dir)]
            )
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call,unused-ignore]
        ray.shutdown()
    path = args.results_dir / f"online-{args.tag}.json"
    result = json.loads(path.read_text())
    result["serve_overhead"]["probes"] = probes
    result["machine"] = {"cpus": os.cpu_count(), "note": "client, proxy, replica and rank share the host"}
    result["ingress"] = args.ingress
    result["gpu_shared_by_both_engines"] = share_gpu
    result["engine_options_both_sides"] = args.engine
    # HAProxy's own settings come from the environment (Ray reads them when it writes the config).
    result["haproxy_env"] = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_HAPROXY_")}
    result["served_model"] = {"tiny": "embedded tiny model", "flashinfer": {"qwen3": FLASHINFER_TINY}}[
        args.model
    ]
    path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
