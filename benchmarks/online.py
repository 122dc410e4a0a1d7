"""`tandem bench online`: load a running server's OpenAI API and report serving latency and throughput.

Each sweep point sends `--num-prompts` streaming requests, either as Poisson arrivals at a rate
(`--rates`, open loop) or from a fixed number of clients (`--concurrency`, closed loop), and reports
TTFT, ITL, TPOT and E2E percentiles, throughput and goodput. `--serve-overhead` measures what Ray Serve
adds to TTFT: HTTP against the server minus `LLMReplica.generate` in this process, at low load.

    python benchmarks/online.py --base-url http://127.0.0.1:8000 --model tandem-tiny \
        --rates 1,2,4 --num-prompts 100 --input-len 256 --output-len 64 --tag tiny-cpu

Results go to benchmarks/results/online-<tag>.json (and .png). See docs/benchmarks.md.

`--vs-offline` instead runs the in-process `LLM` and `tandem serve` with its defaults on the same
workload, in one run, and reports their ratio (benchmarks/online_vs_offline.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tandem.benchmarks import online_report as report
from tandem.benchmarks.loadgen import (
    RequestResult,
    RequestSpec,
    load_dataset,
    poisson_arrivals,
    request_body,
    send_request,
    summarize,
    synthetic_requests,
)
from tandem.benchmarks.serve_overhead import measure_serve_overhead

DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Seed offset of the warm-up prompts: distinct from every sweep point's (seed + index), so no measured
# prompt was cached by an earlier one (the overhead probe has its own, in serve_overhead.py).
WARMUP_SEED = 1_000_003
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem bench online",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root (no /v1).")
    p.add_argument("--model", default="tandem-tiny", help="Served model name put in each request.")
    p.add_argument("--endpoint", choices=sorted(ROUTES), default="completions", help="OpenAI route to load.")
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--rates", type=_rates, help="Poisson arrival rates, req/s, comma-separated ('inf' ok)."
    )
    load.add_argument("--concurrency", type=_ints, help="Closed-loop client counts, comma-separated.")
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="Requests per sweep point.")
    p.add_argument("--seed", type=int, default=0, help="Seed of prompts, lengths and arrivals.")
    p.add_argument("--input-len", type=_positive_int, default=256, help="Prompt length (tokens).")
    p.add_argument("--output-len", type=_positive_int, default=64, help="max_tokens (ignore_eos is set).")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Draw lengths uniformly from [len*(1-r), len*(1+r)]; 0 keeps them fixed.",
    )
    p.add_argument(
        "--dataset", type=Path, help="JSONL of {prompt: text|[ids], output_len}; overrides the length flags."
    )
    p.add_argument(
        "--prompt-kind",
        choices=["ids", "text"],
        default="ids",
        help="Random token-id prompts (exact lengths) or random words (chat needs text).",
    )
    p.add_argument("--vocab-size", type=_positive_int, default=500, help="Random ids are drawn from [0, N).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature of every request.")
    p.add_argument("--goodput-ttft-ms", type=_positive_float, help="TTFT limit of goodput (unset: no limit).")
    p.add_argument("--goodput-tpot-ms", type=_positive_float, help="TPOT limit of goodput (unset: no limit).")
    p.add_argument("--warmup-requests", type=_count, default=2, help="Unmeasured requests sent first.")
    p.add_argument("--request-timeout-s", type=_positive_float, default=300.0, help="Bound on one request.")
    p.add_argument("--point-timeout-s", type=_positive_float, default=600.0, help="Bound on one sweep point.")
    p.add_argument("--max-duration-s", type=_positive_float, default=3600.0, help="Bound on the whole run.")
    p.add_argument("--tag", help="Names the files online-<tag>.json/.png; None means <model>-<mode>.")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR, help="Where JSON and PNG go.")
    p.add_argument("--no-plot", action="store_true", help="Skip the PNG.")
    ovh = p.add_argument_group("serve overhead (TTFT over HTTP minus TTFT of LLMReplica.generate in-process)")
    ovh.add_argument("--serve-overhead", action="store_true", help="Measure it (after any sweep).")
    ovh.add_argument("--overhead-requests", type=_positive_int, default=30, help="Sequential pairs.")
    ovh.add_argument("--overhead-input-len", type=_positive_int, default=32, help="Prompt length (tokens).")
    ovh.add_argument("--overhead-max-tokens", type=_positive_int, default=4, help="max_tokens of each.")
    ovh.add_argument(
        "--overhead-model", help="Model dir or hub id of the server's model (unset: the embedded tiny model)."
    )
    ovh.add_argument("--overhead-device", choices=["auto", "cpu", "cuda"], default="auto", help="Its device.")
    ovh.add_argument(
        "--overhead-engine",
        type=_json_object,
        default={},
        help="Engine options as JSON, the same as the server's (e.g. '{\"page_size\": 4}'). On a shared "
        "GPU give both a mem_fraction that fits.",
    )
    ovh.add_argument(
        "--overhead-direct-url",
        help="Also time each pair at this URL (HAProxy mode: a replica's own /v1/completions), to split "
        "HAProxy's share from the rest.",
    )
    ovh.add_argument(
        "--overhead-ray-address",
        default="local",
        help="Ray for the replica when none is initialized: 'local' starts a private one; 'auto' joins.",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if "--vs-offline" in words:  # its own flags: see benchmarks/online_vs_offline.py
        from tandem.benchmarks.online_vs_offline import main as vs_offline

        return vs_offline([w for w in words if w != "--vs-offline"])
    parser = build_parser()
    args = parser.parse_args(words)
    if args.rates is None and args.concurrency is None and not args.serve_overhead:
        parser.error("give --rates or --concurrency (or --serve-overhead alone)")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.endpoint == "chat" and args.prompt_kind == "ids" and args.dataset is None:
        parser.error("--endpoint chat needs text prompts: add --prompt-kind text")
    try:
        result = asyncio.run(run(args))
    except (ValueError, OSError) as exc:  # bad dataset, unreachable results dir: name it, no traceback
        print(f"tandem bench online: {exc}", file=sys.stderr)
        return 2
    path = report.write(result, args.results_dir, args.tag or default_tag(args), plot=not args.no_plot)
    print(f"wrote {path}")
    return 1 if _all_requests_failed(result) else 0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.perf_counter() + args.max_duration_s
    url = args.base_url.rstrip("/") + ROUTES[args.endpoint]
    mode, loads = ("rate", args.rates) if args.rates is not None else ("concurrency", args.concurrency or [])
    # Every point's prompts are made, and checked against the endpoint, before the first request: a bad
    # dataset fails at once, and making prompts costs no measured time.
    workloads = [make_specs(args, args.num_prompts, seed=args.seed + i) for i in range(len(loads))]
    for spec in (spec for specs in workloads for spec in specs):
        request_body(spec, args.model, args.endpoint, args.temperature)
    # One connection pool for the run, unbounded so the client never queues a request the arrival
    # process has released. aiohttp (not httpx): its per-request cost is lower, and at a 2 ms budget the
    # client's own overhead would show. Proxies from the environment are ignored (trust_env False).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as client:
        await _warm_up(client, url, args)
        points = []
        for index, (load, specs) in enumerate(zip(loads, workloads)):
            if time.perf_counter() >= deadline:
                print(f"--max-duration-s reached: skipping {mode} {load} and after", file=sys.stderr)
                break
            point_deadline = min(deadline, time.perf_counter() + args.point_timeout_s)
            if mode == "rate":
                run_point = run_open_loop(client, url, args, specs, load, args.seed + index, point_deadline)
            else:
                run_point = run_closed_loop(client, url, args, specs, int(load), point_deadline)
            results, not_sent, duration = await run_point
            summary = summarize(
                results,
                duration,
                ttft_slo_ms=args.goodput_ttft_ms,
                tpot_slo_ms=args.goodput_tpot_ms,
                not_sent=not_sent,
            )
            point = {mode: _json_number(load), **summary}
            print(report.point_line(mode, load, point), flush=True)
            points.append(point)
        overhead = None
        if args.serve_overhead:
            try:
                overhead = await measure_serve_overhead(client, url, args, deadline)
            except Exception as exc:  # keep the sweep's results: report why the replica side failed
                print(f"serve overhead failed: {exc!r}", file=sys.stderr)
                overhead = {"error": f"{type(exc).__name__}: {exc}"}
    return {"mode": mode if loads else None, "points": points, "serve_overhead": overhead, "args": args}


def make_specs(args: argparse.Namespace, count: int, seed: int) -> list[RequestSpec]:
    if args.dataset is not None:
        return load_dataset(args.dataset, count)
    return synthetic_requests(
        count,
        args.input_len,
        args.output_len,
        range_ratio=args.random_range_ratio,
        vocab_size=args.vocab_size,
        prompt_kind=args.prompt_kind,
        seed=seed,
    )


async def run_open_loop(
    client: aiohttp.ClientSession,
    url: str,
    args: argparse.Namespace,
    specs: list[RequestSpec],
    rate: float,
    seed: int,
    deadline: float,
) -> tuple[list[RequestResult], int, float]:
    """Send at Poisson times whatever the server's state (an open loop: queues build past capacity)."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    for spec, offset in zip(specs, poisson_arrivals(rate, len(specs), seed)):
        if start + offset >= deadline:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(_send(client, url, args, spec, deadline)))
    # Each request is bounded by the deadline itself, so this gather ends by then.
    results = list(await asyncio.gather(*tasks))
    return results, len(specs) - len(tasks), time.perf_counter() - start


async def run_closed_loop(
    client: aiohttp.ClientSession,
    url: str,
    args: argparse.Namespace,
    specs: list[RequestSpec],
    concurrency: int,
    deadline: float,
) -> tuple[list[RequestResult], int, float]:
    """`concurrency` clients, each sending its next request as soon as its last one ends."""
    pending = iter(specs)  # shared: every spec is taken by exactly one client
    start = time.perf_counter()

    async def client_loop() -> list[RequestResult]:
        done = []
        for spec in pending:
            if time.perf_counter() >= deadline:
                break
            done.append(await _send(client, url, args, spec, deadline))
        return done

    per_client = await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(specs)))))
    results = [r for batch in per_client for r in batch]
    return results, len(specs) - len(results), time.perf_counter() - start


async def _send(
    client: aiohttp.ClientSession, url: str, args: argparse.Namespace, spec: RequestSpec, deadline: float
) -> RequestResult:
    body = request_body(spec, args.model, args.endpoint, args.temperature)
    timeout = min(args.request_timeout_s, deadline - time.perf_counter())
    return await send_request(client, url, body, spec.input_len, timeout)


async def _warm_up(client: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> None:
    # The first requests pay for lazy setup (connections, compiled kernels, Serve's routing tables).
    kind = "text" if args.endpoint == "chat" else "ids"
    for spec in synthetic_requests(
        args.warmup_requests,
        args.input_len,
        4,
        vocab_size=args.vocab_size,
        prompt_kind=kind,
        seed=args.seed + WARMUP_SEED,
    ):
        result = await _send(client, url, args, spec, time.perf_counter() + args.request_timeout_s)
        if not result.ok:
            print(f"warm-up request failed: {result.error}", file=sys.stderr)


def default_tag(args: argparse.Namespace) -> str:
    mode = "rates" if args.rates is not None else "conc" if args.concurrency is not None else "overhead"
    name = Path(args.model).name or "model"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{name}-{mode}")


def _all_requests_failed(result: dict[str, Any]) -> bool:
    points = result["points"]
    return bool(points) and all(p["completed"] == 0 for p in points)


def _json_number(value: float) -> float | int | str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"  # JSON has no infinity
    return value


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: `convert`, then reject what fails `ok` with a message naming the rule."""

    def parse(text: str) -> Any:
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    parse.__name__ = rule  # argparse names the type in its "invalid ... value" message
    return parse


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None


def _list_of(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [convert(part) for part in text.split(",") if part.strip()]


_positive_int = _checked(int, lambda v: v >= 1, ">= 1")
_count = _checked(int, lambda v: v >= 0, ">= 0")
_positive_float = _checked(float, lambda v: v > 0, "> 0")
_json_object = _checked(_json, lambda v: isinstance(v, dict), "a JSON object")
_rates = _checked(_list_of(float), lambda vs: bool(vs) and all(v > 0 for v in vs), "rates > 0 (or inf)")
_ints = _checked(_list_of(int), lambda vs: bool(vs) and all(v >= 1 for v in vs), "counts >= 1")


if __name__ == "__main__":
    sys.exit(main())
