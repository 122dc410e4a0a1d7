"""The load generator of `tandem bench online`: request specs, arrivals, the streaming client, metrics.

Everything here but `send_request` is pure, so the unit tests check it on synthetic input without a
server. Times are `time.perf_counter()` seconds; reports are in milliseconds.

Definitions (those of vLLM's and SGLang's serving benchmarks, so figures compare):
- TTFT: first content chunk received minus request sent.
- ITL: the gaps between consecutive content chunks (one per chunk, not per token).
- TPOT: (E2E - TTFT) / (output_tokens - 1); undefined for a single output token.
- E2E: end of the stream (`[DONE]` or the connection closing) minus request sent.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

DONE = "[DONE]"
PERCENTILES = (50, 90, 99)
# Common English words: BPE vocabularies hold each as one or two tokens, so a text prompt of n words is
# roughly n tokens. Text prompts exist for the chat endpoint; token-id prompts give exact lengths.
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word"
)


class SSEParser:
    """Turns a text stream of server-sent events into their `data` payloads, however the network splits it.

    An event ends at a blank line; its `data:` lines are joined with newlines (the SSE rule). Comments
    (`:` lines, used as keep-alives) and the other fields (`event:`, `id:`, `retry:`) are dropped.
    """

    def __init__(self) -> None:
        self._partial_line = ""
        self._data_lines: list[str] = []

    def feed(self, text: str) -> list[str]:
        lines = (self._partial_line + text).split("\n")
        self._partial_line = lines.pop()  # no newline yet: the rest of it comes with the next read
        payloads: list[str] = []
        for raw in lines:
            self._take_line(raw.rstrip("\r"), payloads)
        return payloads

    def close(self) -> list[str]:
        """Payloads of an event the server left unterminated when it closed the stream."""
        payloads: list[str] = []
        if self._partial_line:
            self._take_line(self._partial_line.rstrip("\r"), payloads)
            self._partial_line = ""
        self._take_line("", payloads)
        return payloads

    def _take_line(self, line: str, payloads: list[str]) -> None:
        if not line:
            if self._data_lines:
                payloads.append("\n".join(self._data_lines))
                self._data_lines = []
        elif line.startswith("data:"):
            value = line[5:]
            self._data_lines.append(value[1:] if value.startswith(" ") else value)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: a prompt (token ids or text) and how many tokens to ask for."""

    prompt: str | list[int]
    input_len: int  # tokens for id prompts; words (about tokens) for text prompts
    output_len: int


@dataclass
class RequestResult:
    """What one streamed request did. `error` is None for a request that completed."""

    send_time: float
    input_len: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried content
    end_time: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    # A model whose LM head is wider than its tokenizer may stream tokens that are no text at all; for it,
    # a stream that ended with [DONE] and usage is complete even with no content chunk.
    allow_empty: bool = False
    _usage_tokens: int | None = None
    _done: bool = False

    def observe(self, payload: str, now: float) -> None:
        """Account for one SSE payload that arrived at `now`."""
        if payload == DONE:
            self._done = True
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            self.fail(f"invalid JSON in the stream: {payload[:80]!r}")
            return
        if not isinstance(event, dict):
            self.fail(f"unexpected stream event: {payload[:80]!r}")
            return
        if "error" in event:  # the server failed after the 200 status line was sent
            error = event["error"]
            self.fail(f"error event: {error.get('message') if isinstance(error, dict) else error}")
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")
        for choice in event.get("choices") or ():
            # Completions stream `text`; chat streams `delta.content` (its first delta carries only a role).
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                self.chunk_times.append(now)
                break

    def fail(self, message: str) -> None:
        if self.error is None:  # keep the first cause; later ones are usually its consequences
            self.error = message

    def finish(self, now: float) -> None:
        self.end_time = now
        self.output_tokens = self._usage_tokens if self._usage_tokens is not None else len(self.chunk_times)
        if self.error is None and not self._done:
            self.fail("the stream ended without [DONE]")
        if self.error is None and not self.chunk_times and not (self.allow_empty and self._usage_tokens):
            self.fail("the stream carried no content")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- arrivals and request specs ---------------------------------------------------------------------
def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send offsets (s) of `count` requests arriving as a Poisson process of `rate` req/s.

    The first request goes at 0; the gaps after it are exponential with mean 1/rate. An infinite rate
    sends everything at once.
    """
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()  # type: ignore[no-any-return]


def sample_lengths(mean: int, range_ratio: float, count: int, rng: np.random.Generator) -> list[int]:
    """`count` lengths uniform in [mean * (1 - r), mean * (1 + r)] (at least 1); r = 0 gives `mean`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count).tolist()  # type: ignore[no-any-return]


def synthetic_requests(
    count: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    vocab_size: int = 500,
    prompt_kind: str = "ids",
    seed: int = 0,
) -> list[RequestSpec]:
    """Random prompts, different for every request so a prefix cache does not flatter the figures."""
    rng = np.random.default_rng(seed)
    words = _WORDS.split()
    inputs = sample_lengths(input_len, range_ratio, count, rng)
    outputs = sample_lengths(output_len, range_ratio, count, rng)
    specs = []
    for n_in, n_out in zip(inputs, outputs):
        if prompt_kind == "ids":
            prompt: str | list[int] = rng.integers(0, vocab_size, size=n_in).tolist()
        elif prompt_kind == "text":
            prompt = " ".join(words[i] for i in rng.integers(0, len(words), size=n_in))
        else:
            raise ValueError(f"prompt kind must be 'ids' or 'text', got {prompt_kind!r}")
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


def load_dataset(path: Path, count: int) -> list[RequestSpec]:
    """Requests from a JSONL file of `{"prompt": str | [ids], "output_len": int}` lines, cycled to `count`.

    `max_tokens` is accepted for `output_len`; `input_len` is optional (default: the prompt's length in
    ids, or in words for text).
    """
    specs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt")
        output_len = row.get("output_len", row.get("max_tokens"))
        valid_prompt = (isinstance(prompt, str) and prompt) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        )
        if not valid_prompt or not isinstance(output_len, int) or output_len < 1:
            raise ValueError(
                f"{path}:{number}: each line needs a non-empty 'prompt' (text or token ids) and an "
                f"'output_len' >= 1"
            )
        input_len = row.get("input_len", len(prompt) if isinstance(prompt, list) else len(prompt.split()))
        specs.append(RequestSpec(prompt, int(input_len), output_len))
    if not specs:
        raise ValueError(f"{path}: the dataset has no requests")
    return [specs[i % len(specs)] for i in range(count)]


# ---- the client -------------------------------------------------------------------------------------
def request_body(spec: RequestSpec, model: str, endpoint: str, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": temperature,
        "ignore_eos": True,  # every request generates exactly output_len tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError(
                "the chat endpoint takes text prompts only (--prompt-kind text, or text in --dataset)"
            )
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    input_len: int,
    timeout_s: float,
    *,
    allow_empty: bool = False,
) -> RequestResult:
    """Send one streaming request and time its chunks. Never raises for a failed request: the failure
    is in `result.error`."""
    result = RequestResult(send_time=time.perf_counter(), input_len=input_len, allow_empty=allow_empty)
    try:
        await asyncio.wait_for(_stream(session, url, body, result), timeout=max(timeout_s, 0.0))
    except asyncio.TimeoutError:
        result.fail(f"timed out after {timeout_s:.1f}s")
    except (aiohttp.ClientError, OSError) as exc:
        result.fail(f"{type(exc).__name__}: {exc}")
    result.finish(time.perf_counter())
    return result


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], result: RequestResult
) -> None:
    parser = SSEParser()
    # Network reads may split a UTF-8 character; the incremental decoder holds its first bytes back.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raw = await response.text(errors="replace")
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:200]
            result.fail(f"HTTP {response.status}: {message}")
            return
        async for raw_bytes in response.content.iter_any():  # whatever has arrived, as soon as it has
            now = time.perf_counter()  # one timestamp per read: the events in it arrived together
            for payload in parser.feed(decoder.decode(raw_bytes)):
                result.observe(payload, now)
        now = time.perf_counter()
        for payload in parser.feed(decoder.decode(b"", final=True)) + parser.close():
            result.observe(payload, now)


# ---- metrics ----------------------------------------------------------------------------------------
def latency_stats(seconds: Iterable[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in ms (linear interpolation between samples); None when there are none."""
    values = np.asarray(list(seconds), dtype=np.float64) * 1e3
    if values.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    stats = {"mean": float(values.mean())}
    stats.update({f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES})
    return {k: round(v, 3) for k, v in stats.items()}


def meets_slo(result: RequestResult, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """A completed request within both limits; an unset limit always holds, and so does the TPOT limit
    for a single-token output (it has no TPOT)."""
    if not result.ok:
        return False
    if ttft_ms is not None and result.ttft * 1e3 > ttft_ms:
        return False
    tpot = result.tpot
    return tpot_ms is None or tpot is None or tpot * 1e3 <= tpot_ms


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    not_sent: int = 0,
) -> dict[str, Any]:
    """The figures of one sweep point. Rates are over `duration_s`, the point's wall time."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    timed = [r for r in done if r.chunk_times]  # an empty stream (allow_empty) has no TTFT, ITL or TPOT
    tpots = [t for t in (r.tpot for r in timed) if t is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(failed),
        "not_sent": not_sent,  # left unsent when the point's time bound ran out
        "errors": dict(Counter(r.error for r in failed if r.error is not None).most_common(10)),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(done) * per_s, 4),
        "output_throughput": round(output_tokens * per_s, 3),
        "goodput": round(sum(meets_slo(r, ttft_slo_ms, tpot_slo_ms) for r in timed) * per_s, 4),
        "total_output_tokens": output_tokens,
        "total_input_tokens": sum(r.prompt_tokens or r.input_len for r in done),
        "ttft_ms": latency_stats(r.ttft for r in timed),
        "tpot_ms": latency_stats(tpots),
        "itl_ms": latency_stats(itl for r in timed for itl in r.itls),
        "e2e_ms": latency_stats(r.e2e for r in done),
    }
