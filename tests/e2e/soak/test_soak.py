"""tandem loses nothing and never hangs. A soak, an overload burst and hand-written fuzz cases
against one CPU Serve app on loopback (tiny Qwen3, TP=1).

The soak's size is `--soak-requests N` (or TANDEM_SOAK_REQUESTS): 1000 in CI, 10000 for the long form:

    pytest tests/e2e/soak/test_soak.py --soak-requests 10000 -s

Every loop here is bounded in count and in time: each request by `REQUEST_TIMEOUT_S`, the soak by
`soak_budget_s`, every wait for idleness by a deadline.

The soak's request mix and the loop that sends it (`soak_request`, `soak_violation`, `run_soak`,
`soak_budget_s`, `wait_idle`) live in tests/e2e/conftest.py, reached through the `traffic` fixture.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

MAX_ONGOING, MAX_QUEUED = 16, 16
# Serve counts a request as queued until its router hands it to a replica, and under load the router
# learns late that a replica slot came free. A client with more requests in flight than
# max_queued_requests can so be turned away below the configured capacity (docs/reliability.md). The
# soak stays at that bound, where no 503 is legitimate; the overload tests go past it on purpose.
CONCURRENCY = MAX_QUEUED
REQUEST_TIMEOUT_S = 60.0
# RSS growth between the warm-up and the end of the soak. Measured on a 2-core box: ~2 MiB (rank) and
# ~4-6 MiB (replica) over 1000 requests, ~9 and ~8 MiB over 10000. The rank's share is mostly its debug
# ring of the last 100k sampled tokens (`RankWorker.sampled_tokens`, ~12 MiB when full): bounded, not a
# leak. A leak of 4 KiB a request passes these bounds within the long form's 10000 requests.
RANK_RSS_GROWTH_BOUND_MIB = 32.0
REPLICA_RSS_GROWTH_BOUND_MIB = 64.0  # the LLMServer actor: the Python side of every request

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-soak",
        "device": "cpu",
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
    }
    with serve_app_context(args, name="tandem-soak") as running:
        yield running


# ---- the soak ---------------------------------------------------------------------------------------


def test_soak_loses_nothing_and_memory_stays_flat(
    app: Any,
    request: pytest.FixtureRequest,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    ray_actors: Any,
    reliability_figures: dict[str, Any],
    traffic: Any,
) -> None:
    total = int(request.config.getoption("--soak-requests"))
    warmup = min(200, total // 5)
    ranks = ray_actors.alive("RankWorker")
    replicas = ray_actors.alive("LLMServer")
    assert len(ranks) == 1 and len(replicas) == 1
    soak_limits = {"concurrency": CONCURRENCY, "timeout_s": REQUEST_TIMEOUT_S}

    async def run() -> tuple[Any, Any, dict[str, float], dict[str, float], dict[str, Any]]:
        warm = await traffic.run_soak(
            app, openai_call, open_session, 0, warmup, traffic.soak_budget_s(warmup), **soak_limits
        )
        await traffic.wait_idle(app)
        before = {pid_label: ray_actors.rss_mib(pid) for pid_label, pid in _pids(ranks, replicas).items()}
        main = await traffic.run_soak(
            app,
            openai_call,
            open_session,
            warmup,
            total - warmup,
            traffic.soak_budget_s(total - warmup),
            **soak_limits,
        )
        stats = await traffic.wait_idle(app)
        after = {pid_label: ray_actors.rss_mib(pid) for pid_label, pid in _pids(ranks, replicas).items()}
        return warm, main, before, after, stats

    warm, main, before, after, stats = asyncio.run(run())
    results = warm.outcomes + main.outcomes
    assert len(results) == total, f"the soak ran out of time: {len(results)} of {total} requests ended"
    violations = [(req, v) for req, out in results if (v := traffic.soak_violation(req, out)) is not None]
    kinds = Counter(req.kind for req, _ in results)
    statuses = Counter(out.status for _, out in results)
    growth = {label: after[label] - before[label] for label in before}
    latencies = sorted(out.seconds for req, out in results if req.kind == "valid")
    reliability_figures["soak"] = {
        "requests": total,
        "kinds": dict(kinds),
        "statuses": {str(k): v for k, v in statuses.items()},
        "streams": sum(1 for req, _ in results if isinstance(req.body, dict) and req.body.get("stream")),
        "chat": sum(1 for req, _ in results if req.path.endswith("chat/completions")),
        "n2": sum(1 for req, _ in results if req.n == 2),
        "with_stop": sum(1 for req, _ in results if req.stop),
        "violations": len(violations),
        "concurrency": CONCURRENCY,
        "seconds": round(warm.seconds + main.seconds, 1),
        "requests_per_s": round(total / (warm.seconds + main.seconds), 1),
        "valid_latency_p50_s": round(statistics.median(latencies), 3),
        "valid_latency_max_s": round(latencies[-1], 3),
        "rss_before_mib": {k: round(v, 1) for k, v in before.items()},
        "rss_growth_mib": {k: round(v, 2) for k, v in growth.items()},
        "stats_after": {k: stats[k] for k in ("kv_pages_used", "num_running", "num_waiting")},
    }
    print(f"\nsoak figures: {json.dumps(reliability_figures['soak'])}")
    assert not violations, [f"{req.kind} {req.path} {req.body!r:.200}: {why}" for req, why in violations[:10]]
    assert all(status is not None and status < 500 for status in statuses), statuses
    assert kinds["closed"] > 0 and kinds["invalid"] > 0
    assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    for label, grown in growth.items():
        bound = RANK_RSS_GROWTH_BOUND_MIB if label.startswith("rank") else REPLICA_RSS_GROWTH_BOUND_MIB
        assert grown < bound, f"{label} grew {grown:.1f} MiB over the soak (bound {bound} MiB)"


def _pids(ranks: dict[str, int], replicas: dict[str, int]) -> dict[str, int]:
    labelled = {f"rank{i}": pid for i, pid in enumerate(sorted(ranks.values()))}
    labelled.update({f"replica{i}": pid for i, pid in enumerate(sorted(replicas.values()))})
    return labelled


# ---- overload: twice what the app can run and queue, all at once -----------------------------------


def test_overload_turns_the_excess_away_within_two_seconds(
    app: Any,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    reliability_figures: dict[str, Any],
    traffic: Any,
) -> None:
    capacity = MAX_ONGOING + MAX_QUEUED
    # 48 tokens keep the first accepted requests running while the whole burst arrives, so each one
    # past capacity meets a full queue.
    body = {"prompt": "overload", "max_tokens": 48, "ignore_eos": True}

    async def run() -> list[Any]:
        async with open_session(app.base_url, 2 * capacity) as session:

            async def connect() -> None:
                async with session.get("/v1/models") as response:
                    await response.read()

            # Open the connections and warm the request path first, so the rejection time measured is
            # the server's answer under load, not TCP set-up or a cold start.
            await asyncio.gather(*(connect() for _ in range(2 * capacity)))
            for stream in (False, True):
                await openai_call(session, CMPL, {**body, "max_tokens": 2, "stream": stream})
            outcomes = await asyncio.gather(
                *(
                    openai_call(session, CMPL, {**body, "stream": i % 2 == 1}, timeout_s=60)
                    for i in range(2 * capacity)
                )
            )
        await traffic.wait_idle(app)
        return list(outcomes)

    outcomes = asyncio.run(run())
    problems = [o.problem for o in outcomes if o.problem is not None]
    accepted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status != 200]
    slowest_rejection = max((o.seconds for o in rejected), default=0.0)
    reliability_figures["overload"] = {
        "sent_at_once": 2 * capacity,
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
        "accepted": len(accepted),
        "rejected": len(rejected),
        "rejection_statuses": sorted({o.status for o in rejected}),
        "rejection_s_max": round(slowest_rejection, 3),
        "rejection_s_p50": round(statistics.median(o.seconds for o in rejected), 3) if rejected else None,
        "accepted_s_max": round(max(o.seconds for o in accepted), 3),
    }
    print(f"\noverload figures: {json.dumps(reliability_figures['overload'])}")
    assert not problems, problems[:5]
    assert all(o.complete for o in accepted), [o.error for o in accepted if not o.complete][:3]
    # Everything running and queued is served; only the excess may be turned away (a burst can cost a
    # few more, see CONCURRENCY), and at least that excess, less what finished while it arrived, is.
    assert len(accepted) >= MAX_ONGOING, len(accepted)
    assert rejected, "twice the capacity at once and nothing was turned away"
    for outcome in rejected:
        assert outcome.status in (429, 503) and outcome.error is not None
        assert outcome.error["code"] == "overloaded", outcome.error
    # The replica's `Admission` rejects at once; the time is the path to it. Through Serve's Python
    # proxy each request's ASGI messages reach the replica by actor calls, and on a 2-core box shared
    # with a decoding rank the burst arrives there spread out (figures in docs/reliability.md).
    assert slowest_rejection < 2.0, f"the slowest rejection took {slowest_rejection:.2f}s"


def test_clients_between_the_queue_bound_and_capacity_lose_nothing(
    app: Any,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    reliability_figures: dict[str, Any],
) -> None:
    """24 closed-loop clients: more than max_queued_requests, fewer than running + queued. Serve may turn
    some away early (see CONCURRENCY); what must hold is that each is then a shaped 503, never a cut."""
    clients, per_client = MAX_QUEUED + MAX_ONGOING // 2, 10

    async def run() -> list[Any]:
        async with open_session(app.base_url, clients) as session:

            async def client(c: int) -> list[Any]:
                body = {"max_tokens": 8, "ignore_eos": True}
                return [
                    await openai_call(
                        session, CMPL, {**body, "prompt": f"client {c}.{i}", "stream": i % 2 == 0}
                    )
                    for i in range(per_client)
                ]

            runs = await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(clients))), 120)
        return [o for run in runs for o in run]

    outcomes = asyncio.run(run())
    rejected = [o for o in outcomes if o.status != 200]
    reliability_figures["closed_loop_above_queue_bound"] = {
        "clients": clients,
        "requests": len(outcomes),
        "rejected_503": len(rejected),
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
    }
    print(f"\nclosed-loop figures: {json.dumps(reliability_figures['closed_loop_above_queue_bound'])}")
    assert all(o.problem is None for o in outcomes), [o.problem for o in outcomes if o.problem][:5]
    assert all(o.complete for o in outcomes if o.status == 200)
    assert all(o.status == 503 and o.error and o.error["code"] == "overloaded" for o in rejected)


# ---- hand-written fuzz cases: 200 or 4xx, never a 5xx ------------------------------------------------
# (the schemathesis run against /openapi.json lives in test_errors.py)


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


FUZZ_CASES: list[tuple[str, str, dict[str, Any] | bytes]] = [
    # unicode and emoji
    ("emoji", CMPL, {"prompt": "🦊🔥 naïve café — 日本語 עברית", "max_tokens": 4}),
    ("zwj-emoji-chat", CHAT, {"messages": user("👩‍👩‍👧‍👦 e\u0301 \u202ertl\u202c"), "max_tokens": 4}),
    ("control-chars", CMPL, {"prompt": "a\x00b\x07c\x1b[31m\ud7ff\ufeff", "max_tokens": 4}),
    ("lone-surrogate", CMPL, b'{"prompt": "x\\ud83e y", "max_tokens": 4}'),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 4}'),
    ("lone-surrogate-model", CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'),
    ("lone-surrogate-stop", CMPL, b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 4}'),
    ("emoji-stop", CMPL, {"prompt": "🦊🦊🦊", "stop": ["🦊", "\ufffd"], "max_tokens": 6}),
    ("emoji-flood", CMPL, {"prompt": "🦊" * 700, "max_tokens": 4}),
    ("token-id-prompts", CMPL, {"prompt": [[5, 6, 7], [8]], "max_tokens": 3}),
    # empty prompts
    ("empty-prompt", CMPL, {"prompt": "", "max_tokens": 4}),
    ("empty-prompt-in-list", CMPL, {"prompt": ["hi", ""], "max_tokens": 4}),
    ("empty-token-list", CMPL, {"prompt": [[]], "max_tokens": 4}),
    ("empty-chat-content", CHAT, {"messages": user(""), "max_tokens": 4}),
    ("no-chat-content", CHAT, {"messages": [{"role": "user"}], "max_tokens": 4}),
    ("empty-parts", CHAT, {"messages": user([]), "max_tokens": 4}),
    ("only-system", CHAT, {"messages": [{"role": "system", "content": ""}], "max_tokens": 4}),
    # max_tokens of 0 or huge
    ("max-tokens-0-chat", CHAT, {"messages": user("hi"), "max_tokens": 0}),
    ("max-completion-tokens-0", CHAT, {"messages": user("hi"), "max_completion_tokens": 0}),
    ("max-tokens-negative", CMPL, {"prompt": "hi", "max_tokens": -1}),
    ("max-tokens-context", CMPL, {"prompt": "hi", "max_tokens": 2048}),
    ("max-tokens-1e9", CMPL, {"prompt": "hi", "max_tokens": 10**9}),
    ("max-tokens-int64", CHAT, {"messages": user("hi"), "max_tokens": 2**63 - 1}),
    ("max-tokens-2^64", CMPL, {"prompt": "hi", "max_tokens": 2**64}),
    ("max-tokens-inf", CMPL, b'{"prompt": "hi", "max_tokens": 1e999}'),
    ("max-tokens-float", CMPL, {"prompt": "hi", "max_tokens": 2.5}),
    # stop lists of 5 or more
    ("stop-5", CMPL, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"], "max_tokens": 6}),
    (
        "stop-8-unicode",
        CHAT,
        {"messages": user("hi"), "stop": ["🦊", "é", "\n\n", "ab", *"wxyz"], "max_tokens": 6},
    ),
    ("stop-64", CMPL, {"prompt": "hi", "stop": [f"s{i}" for i in range(64)], "max_tokens": 6}),
    ("stop-long-strings", CMPL, {"prompt": "hi", "stop": ["x" * 500] * 6, "max_tokens": 6}),
    ("stop-mixed-types", CMPL, {"prompt": "hi", "stop": ["a", 5, "b", None, "c"], "max_tokens": 6}),
    ("stop-token-ids-out-of-vocab", CMPL, {"prompt": "hi", "stop_token_ids": [10**6], "max_tokens": 4}),
    # logprobs over the limit
    ("logprobs-100", CMPL, {"prompt": "hi", "logprobs": 100, "max_tokens": 4}),
    ("logprobs-negative", CMPL, {"prompt": "hi", "logprobs": -1, "max_tokens": 4}),
    ("logprobs-20", CMPL, {"prompt": "hi", "logprobs": 20, "max_tokens": 4}),
    ("top-logprobs-21", CHAT, {"messages": user("hi"), "logprobs": True, "top_logprobs": 21}),
    ("top-logprobs-alone", CHAT, {"messages": user("hi"), "top_logprobs": 3, "max_tokens": 4}),
    ("chat-logprobs-int", CHAT, {"messages": user("hi"), "logprobs": 5, "max_tokens": 4}),
    # wrong types
    ("prompt-int", CMPL, {"prompt": 123, "max_tokens": 4}),
    ("prompt-object", CMPL, {"prompt": {"text": "hi"}, "max_tokens": 4}),
    ("prompt-mixed-list", CMPL, {"prompt": [1, "a"], "max_tokens": 4}),
    ("prompt-negative-id", CMPL, {"prompt": [3, -1], "max_tokens": 4}),
    ("messages-string", CHAT, {"messages": "hi", "max_tokens": 4}),
    ("content-int", CHAT, {"messages": user(5), "max_tokens": 4}),
    ("part-not-text", CHAT, {"messages": user([{"type": "image_url", "image_url": "x"}]), "max_tokens": 4}),
    ("temperature-string", CMPL, {"prompt": "hi", "temperature": "hot", "max_tokens": 4}),
    ("temperature-nan", CMPL, b'{"prompt": "hi", "temperature": NaN, "max_tokens": 4}'),
    ("n-string", CMPL, {"prompt": "hi", "n": "2", "max_tokens": 4}),
    ("n-zero", CHAT, {"messages": user("hi"), "n": 0, "max_tokens": 4}),
    ("n-over-limit", CMPL, {"prompt": "hi", "n": 129, "max_tokens": 4}),
    ("seed-string", CMPL, {"prompt": "hi", "seed": "abc", "max_tokens": 4}),
    ("seed-2^70", CMPL, {"prompt": "hi", "seed": 2**70, "max_tokens": 4}),
    ("stream-options-bad", CMPL, {"prompt": "hi", "stream_options": {"include_usage": "maybe"}}),
    ("model-int", CHAT, {"model": 7, "messages": user("hi"), "max_tokens": 4}),
    ("template-kwargs-clash", CHAT, {"messages": user("hi"), "chat_template_kwargs": {"messages": []}}),
    ("template-kwargs-list", CHAT, {"messages": user("hi"), "chat_template_kwargs": [1, 2]}),
    ("body-list", CMPL, b"[]"),
    ("body-null", CHAT, b"null"),
    ("body-string", CMPL, b'"prompt"'),
    ("body-deep", CMPL, b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
    ("body-not-utf8", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
]


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in FUZZ_CASES], ids=[c[0] for c in FUZZ_CASES])
def test_fuzz_case_is_200_or_4xx(
    app: Any, openai_call: Callable[..., Any], open_session: Callable[..., Any], path: str, body: Any
) -> None:
    variants: list[dict[str, Any] | bytes] = [body]
    if isinstance(body, dict):  # the same body streamed: errors after the status line must be shaped too
        variants.append({**body, "stream": True})

    async def run() -> list[Any]:
        async with open_session(app.base_url, 2) as session:
            return [await openai_call(session, path, v, timeout_s=60) for v in variants]

    for outcome in asyncio.run(run()):
        assert outcome.problem is None, outcome.problem
        assert outcome.status is not None and (outcome.status == 200 or 400 <= outcome.status < 500), outcome
        if outcome.status == 200:
            assert outcome.complete, outcome
        else:
            assert outcome.explicit_error, outcome
    if isinstance(body, dict):  # the handle API answers the same bodies; never with an internal error
        method = app.handle.chat_completions if path == CHAT else app.handle.completions
        answer = method.remote(body).result(timeout_s=60)
        assert answer.get("error", {}).get("code") != "internal_error", answer


def test_fuzz_cases_leave_nothing_running(app: Any, traffic: Any) -> None:
    stats = asyncio.run(traffic.wait_idle(app))
    assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
