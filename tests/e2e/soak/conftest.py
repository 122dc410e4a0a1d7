"""The soak's request mix, how an outcome breaks its promise, and the traffic loop that sends it
(tests/e2e/soak/test_soak.py). The Serve app and the HTTP client come from tests/e2e/conftest.py."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
WORDS = ["the fox", "jumps over", "a lazy dog", "while seven", "quiet owls", "watch from", "old oak trees"]
STOP_CHOICES = ["e", "th", " o", "\n", "a", "🦊"]


async def wait_idle(app: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """Stats once no request runs, waits or holds KV pages, or the last stats at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = dict(await app.handle.stats.remote())
        idle = stats["kv_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


@dataclass
class SoakRequest:
    kind: str  # "valid", "closed" (the client leaves mid-stream) or "invalid"
    path: str
    body: dict[str, Any] | bytes
    n: int = 1
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False


# 5% of the soak: bodies that must come back as a shaped 4xx, each a different way to be wrong.
INVALID_BODIES: list[tuple[str, dict[str, Any] | bytes]] = [
    (CMPL, b'{"prompt": "cut off", '),
    (CMPL, {"prompt": "hi", "temperature": -1}),
    (CHAT, {"messages": []}),
    (CMPL, {"prompt": [], "max_tokens": 4}),
    (CMPL, {"prompt": "hi", "max_tokens": 0}),
    (CHAT, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    (CMPL, {"prompt": "hi", "logprobs": 99}),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 4}),
    (CMPL, {"prompt": "hi", "n": "many"}),
]


def soak_request(i: int) -> SoakRequest:
    """Request i of the mix; a pure function of i, so a failure names a request that can be replayed."""
    rng = random.Random(i)
    roll = rng.random()
    chat = rng.random() < 0.5
    path = CHAT if chat else CMPL
    text = " ".join(rng.choices(WORDS, k=rng.randint(2, 24))) + f" #{i % 97}"
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    if roll < 0.05:
        path, invalid = INVALID_BODIES[i % len(INVALID_BODIES)]
        return SoakRequest("invalid", path, invalid)
    if roll < 0.15:
        # Long enough to be surely mid-stream when the client leaves after its first chunk.
        body.update(stream=True, max_tokens=64, ignore_eos=True)
        return SoakRequest("closed", path, body, max_tokens=64)
    request = SoakRequest("valid", path, body, max_tokens=rng.randint(4, 12))
    body.update(max_tokens=request.max_tokens, temperature=rng.choice([0.0, 0.7, 1.0]))
    if rng.random() < 0.5:
        body["stream"] = True
        request.include_usage = rng.random() < 0.5
        if request.include_usage:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.15:
        request.n = body["n"] = 2
    if rng.random() < 0.25:
        request.stop = body["stop"] = rng.sample(STOP_CHOICES, rng.randint(1, 3))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.1:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    return request


def soak_violation(request: SoakRequest, outcome: Any) -> str | None:
    """Why this outcome breaks the soak's promise, or None."""
    if outcome.problem is not None:
        return outcome.problem
    if outcome.status is not None and outcome.status >= 500:
        return f"HTTP {outcome.status}: {outcome.error}"
    if request.kind == "invalid":
        if not (outcome.status is not None and 400 <= outcome.status < 500 and outcome.explicit_error):
            return f"an invalid body got HTTP {outcome.status} ({outcome.error})"
        return None
    if request.kind == "closed":
        return None if outcome.status == 200 and outcome.closed_by_client else f"not closed: {outcome}"
    # Nothing fails in this app, so a valid request must get its whole answer, not merely an error.
    if not outcome.complete:
        return f"incomplete: HTTP {outcome.status}, error {outcome.error}, finish {outcome.finish}"
    if sorted(outcome.finish) != list(range(request.n)):
        return f"choices {sorted(outcome.finish)} for n={request.n}"
    for text in outcome.texts.values():
        if any(s in text for s in request.stop):
            return f"stop strings {request.stop} inside the text {text!r}"
    stream = isinstance(request.body, dict) and request.body.get("stream")
    if not stream or request.include_usage:
        if outcome.usage is None:
            return "no usage"
        if not 0 <= outcome.usage["completion_tokens"] <= request.n * request.max_tokens:
            return f"usage {outcome.usage} for n={request.n}, max_tokens={request.max_tokens}"
    return None


@dataclass
class SoakReport:
    outcomes: list[tuple[SoakRequest, Any]] = field(default_factory=list)
    seconds: float = 0.0


async def run_soak(
    app: Any,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    first: int,
    count: int,
    budget_s: float,
    *,
    concurrency: int,
    timeout_s: float,
) -> SoakReport:
    """Requests first..first+count-1 with `concurrency` in flight, each bounded by `timeout_s`; the
    whole run bounded by budget_s."""
    report = SoakReport()
    next_index = first

    async def worker(session: Any) -> None:
        nonlocal next_index
        while next_index < first + count:
            request = soak_request(next_index)
            next_index += 1
            close_after = 1 if request.kind == "closed" else None
            outcome = await openai_call(
                session,
                request.path,
                request.body,
                close_after_chunks=close_after,
                timeout_s=timeout_s,
            )
            report.outcomes.append((request, outcome))

    start = time.monotonic()
    async with open_session(app.base_url, concurrency) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*workers), budget_s)
        except TimeoutError:
            pass  # the test's count check names how many requests ended in time
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    report.seconds = time.monotonic() - start
    return report


def soak_budget_s(requests: int) -> float:
    # 40-55 requests/s on 2 cores; the budget allows ~6/s plus a minute, so only a real stall trips it.
    return 60.0 + requests * 0.16


class SoakTraffic:
    """The soak's request mix, how an outcome breaks its promise, and the loop that sends it."""

    soak_request = staticmethod(soak_request)
    soak_violation = staticmethod(soak_violation)
    run_soak = staticmethod(run_soak)
    soak_budget_s = staticmethod(soak_budget_s)
    wait_idle = staticmethod(wait_idle)


@pytest.fixture(scope="session")
def traffic() -> type[SoakTraffic]:
    """`traffic.run_soak(...)`, `traffic.soak_violation(...)`, `await traffic.wait_idle(app)`, ..."""
    return SoakTraffic
