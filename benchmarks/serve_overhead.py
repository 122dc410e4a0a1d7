"""What Ray Serve adds to time to first token: HTTP against a running server minus `LLMReplica.generate`
in this process, sequential requests at low load (`tandem bench online --serve-overhead`)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.benchmarks.loadgen import latency_stats, request_body, send_request, synthetic_requests

SERVE_OVERHEAD_TARGET_MS = 2.0  # at p50, on GPU: a tenth of what Ray Serve LLM adds
OVERHEAD_SEED = 2_000_003  # distinct from the sweep's and the warm-up's prompts: none is cached


@dataclass
class Side:
    """What one side of the comparison measured: seconds to first text, per request, and failures."""

    ttft_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)  # in-process only: the first token id
    errors: list[str] = field(default_factory=list)
    # Interleaved runs: each pair's TTFT, None where that request failed, so a failure on one side
    # leaves its pair out instead of misaligning every later pair.
    by_pair: list[float | None] = field(default_factory=list)

    def record(self, ttft: float | None, error: str | None) -> None:
        self.by_pair.append(ttft)
        if ttft is not None:
            self.ttft_s.append(ttft)
        else:
            self.errors.append(error or "no time to first text")

    def aligned(self) -> list[float | None]:
        """Per-pair TTFTs: `by_pair`, or for a Side built from times alone, those times if none failed."""
        if self.by_pair:
            return self.by_pair
        return list(self.ttft_s) if not self.errors else []


def overhead_specs(args: argparse.Namespace, salt: int = 0) -> list[Any]:
    """The probe's prompts; the first two of each side warm up and are not counted. Another `salt`
    gives another set of prompts of the same lengths."""
    return synthetic_requests(
        args.overhead_requests + 2,
        args.overhead_input_len,
        args.overhead_max_tokens,
        vocab_size=args.vocab_size,
        seed=args.seed + OVERHEAD_SEED + 7919 * salt,
    )


@contextlib.asynccontextmanager
async def inprocess_replica(args: argparse.Namespace) -> AsyncIterator[tuple[Any, Any]]:
    """(LLMReplica, SamplingParams) in this process, started and then drained; Ray is started (and
    stopped) here when none is initialized."""
    import ray

    from tandem.replicas.llm_replica import LLMReplica
    from tandem.scheduler.sampling_params import SamplingParams

    started_ray = not ray.is_initialized()
    if started_ray:
        # 'local' is a private cluster: the server's may have no CPU or GPU left for another replica.
        ray.init(address=args.overhead_ray_address, include_dashboard=False, log_to_driver=False)
    replica = LLMReplica(
        args.overhead_model, tp_size=1, device=args.overhead_device, engine=args.overhead_engine
    )
    try:
        await replica.start()
        yield (
            replica,
            SamplingParams(
                max_tokens=args.overhead_max_tokens, temperature=args.temperature, ignore_eos=True
            ),
        )
    finally:
        await replica.shutdown(drain_timeout_s=5.0)
        if started_ray:
            ray.shutdown()


async def _http_once(
    client: aiohttp.ClientSession, url: str, args: argparse.Namespace, spec: Any, side: Side, count: bool
) -> None:
    body = request_body(spec, args.model, "completions", args.temperature)
    result = await send_request(client, url, body, spec.input_len, args.request_timeout_s)
    if count:
        ok = result.ok and result.ttft is not None
        side.record(result.ttft if ok else None, f"http: {result.error}")


async def _inprocess_once(replica: Any, sampling: Any, spec: Any, side: Side, count: bool) -> None:
    assert isinstance(spec.prompt, list)  # synthetic_requests' default kind: token ids
    ttft, first_token, error = await inprocess_ttft(replica, spec.prompt, sampling)
    if not count:
        return
    if first_token is not None:
        side.first_token_s.append(first_token)
    side.record(ttft, f"in-process: {error}")


async def measure_serve_overhead(
    client: aiohttp.ClientSession, url: str, args: argparse.Namespace, deadline: float
) -> dict[str, Any]:
    """TTFT over HTTP minus TTFT of `LLMReplica.generate` in this process, sequential requests (no
    queueing), same prompts and sampling. Pairs alternate, so drift on the host hits both sides alike.

    With `--overhead-direct-url` (the replica's own HTTP port in HAProxy mode) each pair gets a third
    request there, between the two: HTTP through HAProxy minus that is HAProxy's share. It takes prompts
    of its own, since the app's prefix cache would serve it the pair's prompt."""
    http, local, direct = Side(), Side(), Side()
    direct_url = getattr(args, "overhead_direct_url", None)
    specs = overhead_specs(args)
    direct_specs = overhead_specs(args, salt=1) if direct_url else []
    async with inprocess_replica(args) as (replica, sampling):
        for i, spec in enumerate(specs):
            if time.perf_counter() >= deadline:
                break
            await _http_once(client, url, args, spec, http, count=i >= 2)
            if direct_url:
                await _http_once(client, direct_url, args, direct_specs[i], direct, count=i >= 2)
            await _inprocess_once(replica, sampling, spec, local, count=i >= 2)
    return overhead_summary(
        http, local, args, order="interleaved pairs", paired=True, direct=direct if direct_url else None
    )


async def measure_inprocess(args: argparse.Namespace) -> Side:
    """The in-process side alone, for hosts where it cannot share the accelerator with the app (one
    GPU): run it before the app is deployed, then `measure_http`."""
    local = Side()
    async with inprocess_replica(args) as (replica, sampling):
        for i, spec in enumerate(overhead_specs(args)):
            await _inprocess_once(replica, sampling, spec, local, count=i >= 2)
    return local


async def measure_http(url: str, args: argparse.Namespace) -> Side:
    http = Side()
    async with aiohttp.ClientSession(trust_env=False) as client:
        for i, spec in enumerate(overhead_specs(args)):
            await _http_once(client, url, args, spec, http, count=i >= 2)
    return http


def pair_differences(a: Side, b: Side) -> list[float]:
    """a minus b per pair, in seconds, over the pairs where both requests gave a time."""
    left, right = a.aligned(), b.aligned()
    if len(left) != len(right):
        return []
    return [x - y for x, y in zip(left, right) if x is not None and y is not None]


def _median_ms(values: list[float]) -> float | None:
    return round(1e3 * statistics.median(values), 3) if values else None


def overhead_summary(
    http: Side,
    local: Side,
    args: argparse.Namespace,
    *,
    order: str,
    paired: bool = False,
    direct: Side | None = None,
) -> dict[str, Any]:
    http_ms, local_ms = latency_stats(http.ttft_s), latency_stats(local.ttft_s)
    overhead = None
    if http_ms["p50"] is not None and local_ms["p50"] is not None:
        overhead = round(http_ms["p50"] - local_ms["p50"], 3)
    # With alternating pairs, the median of each pair's difference as well: a slow moment of the host
    # lands in both halves of one pair, so it cancels there instead of moving one side's median.
    differences = pair_differences(http, local) if paired else []
    errors = http.errors + local.errors + (direct.errors if direct is not None else [])
    summary = {
        "requests": len(local.ttft_s),
        "order": order,
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "input_len": args.overhead_input_len,
        "max_tokens": args.overhead_max_tokens,
        "http_ttft_ms": http_ms,
        "inprocess_ttft_ms": local_ms,
        "inprocess_first_token_ms": latency_stats(local.first_token_s),
        "overhead_ms_p50": overhead,
        "overhead_ms_paired_p50": _median_ms(differences),
        "pairs_counted": len(differences),
        # Every pair's difference, so runs on one host can be pooled (benchmarks/overhead_pool.py).
        "pair_differences_ms": [round(1e3 * d, 3) for d in differences],
        "target_ms_p50": SERVE_OVERHEAD_TARGET_MS,
    }
    if direct is not None:
        # The replica's own port: HAProxy's share, and what is left without it (Serve's replica server,
        # tandem's HTTP layer, the client).
        summary["direct_ttft_ms"] = latency_stats(direct.ttft_s)
        summary["haproxy_share_ms_paired_p50"] = _median_ms(pair_differences(http, direct))
        summary["direct_overhead_ms_paired_p50"] = _median_ms(pair_differences(direct, local))
    paired_p50 = summary["overhead_ms_paired_p50"]
    print(
        f"serve overhead: TTFT p50 http {http_ms['p50']} ms - in-process {local_ms['p50']} ms = {overhead} ms"
        + (f"; median of pair differences {paired_p50} ms" if paired_p50 is not None else "")
        + (
            f"; HAProxy's share {summary['haproxy_share_ms_paired_p50']} ms, the replica's own port "
            f"{summary['direct_overhead_ms_paired_p50']} ms"
            if direct is not None
            else ""
        )
    )
    return summary


async def inprocess_ttft(
    replica: Any, prompt: list[int], sampling: Any
) -> tuple[float | None, float | None, str | None]:
    """Seconds to the first chunk carrying text and to the first token id, or the error. The stream is
    drained, so the next pair starts with the replica idle.

    Text, not token ids, because that is what the HTTP side can see: a token that is only part of a
    UTF-8 character (common with byte-level BPE) detokenizes to nothing yet, and the server sends no
    chunk for it. Timing ids here would charge Serve with the decode steps until the first character."""
    start = time.perf_counter()
    first: float | None = None
    token: float | None = None
    try:
        async for chunk in replica.generate(prompt, sampling):
            if chunk.token_ids and token is None:
                token = time.perf_counter() - start
            if chunk.text and first is None:
                first = time.perf_counter() - start
            if chunk.error:
                return None, None, str(chunk.error)
    except (RuntimeError, ValueError) as exc:  # rejected or unhealthy: count it, keep measuring
        return None, None, f"{type(exc).__name__}: {exc}"
    return first, token, None if first is not None else "the stream carried no text"
