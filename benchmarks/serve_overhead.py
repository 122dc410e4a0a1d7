"""What Ray Serve adds to time to first token: HTTP against a running server minus `LLMReplica.generate`
in this process, sequential requests at low load (`tandem bench online --serve-overhead`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import aiohttp

from tandem.benchmarks.loadgen import latency_stats, request_body, send_request, synthetic_requests

SERVE_OVERHEAD_TARGET_MS = 2.0  # at p50, on GPU (ARCHITECTURE §3)
OVERHEAD_SEED = 2_000_003  # distinct from the sweep's and the warm-up's prompts: none is cached


async def measure_serve_overhead(
    client: aiohttp.ClientSession, url: str, args: argparse.Namespace, deadline: float
) -> dict[str, Any]:
    """TTFT over HTTP minus TTFT of `LLMReplica.generate` in this process, sequential requests (no
    queueing), same prompts and sampling. Pairs alternate, so drift on the host hits both sides alike."""
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
        sampling = SamplingParams(
            max_tokens=args.overhead_max_tokens, temperature=args.temperature, ignore_eos=True
        )
        specs = synthetic_requests(
            args.overhead_requests + 2,
            args.overhead_input_len,
            args.overhead_max_tokens,
            vocab_size=args.vocab_size,
            seed=args.seed + OVERHEAD_SEED,
        )
        http_s: list[float] = []
        local_s: list[float] = []
        first_token_s: list[float] = []  # in-process, to the first token id (not yet visible text)
        errors: list[str] = []
        for i, spec in enumerate(specs):
            if time.perf_counter() >= deadline:
                break
            body = request_body(spec, args.model, "completions", args.temperature)
            result = await send_request(client, url, body, spec.input_len, args.request_timeout_s)
            assert isinstance(spec.prompt, list)  # synthetic_requests' default kind: token ids
            local, first_token, local_error = await _inprocess_ttft(replica, spec.prompt, sampling)
            if i < 2:  # the first pair of each side warms up
                continue
            if first_token is not None:
                first_token_s.append(first_token)
            for ttft, error, kept, side in (
                (result.ttft if result.ok else None, result.error, http_s, "http"),
                (local, local_error, local_s, "in-process"),
            ):
                if ttft is not None:
                    kept.append(ttft)
                else:
                    errors.append(f"{side}: {error}")
    finally:
        await replica.shutdown(drain_timeout_s=5.0)
        if started_ray:
            ray.shutdown()
    http_ms, local_ms = latency_stats(http_s), latency_stats(local_s)
    overhead = None
    if http_ms["p50"] is not None and local_ms["p50"] is not None:
        overhead = round(http_ms["p50"] - local_ms["p50"], 3)
    summary = {
        "requests": len(local_s),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "input_len": args.overhead_input_len,
        "max_tokens": args.overhead_max_tokens,
        "http_ttft_ms": http_ms,
        "inprocess_ttft_ms": local_ms,
        "inprocess_first_token_ms": latency_stats(first_token_s),
        "overhead_ms_p50": overhead,
        "target_ms_p50": SERVE_OVERHEAD_TARGET_MS,
    }
    print(
        f"serve overhead: TTFT p50 http {http_ms['p50']} ms - in-process {local_ms['p50']} ms = {overhead} ms"
    )
    return summary


async def _inprocess_ttft(
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
