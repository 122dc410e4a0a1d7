"""In-app admission of the one-hop LLMServer (weighted by choices, in arrival order), and the proxy
middleware for replica failures."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tandem.deploy.guards.admission import Admission
from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.routing import proxy_errors
from tandem.deploy.routing.proxy_errors import ShapedProxyErrors


def test_admission_runs_queues_then_turns_away() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_queued=1)
        release = asyncio.Event()
        events: list[str] = []

        async def job(name: str) -> None:
            try:
                async with admission.slot():
                    events.append(f"{name} runs")
                    await release.wait()
            except OpenAIError as exc:
                events.append(f"{name} {exc.status} {exc.code}")

        tasks = [asyncio.create_task(job(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert (admission.running, admission.waiting) == (1, 1)
        release.set()
        await asyncio.gather(*tasks)
        assert (admission.running, admission.waiting) == (0, 0)
        return events

    assert asyncio.run(scenario()) == ["a runs", "c 503 overloaded", "b runs"]


def test_admission_weighs_choices_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=4, max_queued=2)
        events: list[str] = []
        gates = {name: asyncio.Event() for name in "abcd"}

        async def job(name: str, weight: int) -> None:
            try:
                async with admission.slot(weight):
                    events.append(f"{name} runs ({admission.running})")
                    await gates[name].wait()
            except OpenAIError as exc:
                events.append(f"{name} {exc.status}")

        a = asyncio.create_task(job("a", 3))
        await asyncio.sleep(0)
        b = asyncio.create_task(job("b", 100))  # capped at 4: waits for the whole replica
        await asyncio.sleep(0)
        c = asyncio.create_task(job("c", 1))  # would fit now, but b came first
        await asyncio.sleep(0)
        d = asyncio.create_task(job("d", 1))  # the queue (2) is full
        await asyncio.sleep(0.01)
        assert (admission.running, admission.waiting) == (3, 2)
        gates["a"].set()
        await asyncio.sleep(0.01)
        gates["b"].set()
        gates["c"].set()
        await asyncio.gather(a, b, c, d)
        assert (admission.running, admission.waiting) == (0, 0)
        return events

    assert asyncio.run(scenario()) == ["a runs (3)", "d 503", "b runs (4)", "c runs (1)"]


def test_a_cancelled_waiter_lets_the_next_one_in() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_queued=-1)
        hold = asyncio.Event()

        async def job(weight: int) -> None:
            async with admission.slot(weight):
                await hold.wait()

        first = asyncio.create_task(job(1))
        await asyncio.sleep(0)
        heavy = asyncio.create_task(job(2))
        await asyncio.sleep(0)
        light = asyncio.create_task(job(1))
        await asyncio.sleep(0.01)
        assert admission.running == 1 and admission.waiting == 2
        heavy.cancel()
        await asyncio.sleep(0.01)
        assert admission.running == 2 and admission.waiting == 0  # light got in behind the cancelled one
        hold.set()
        await asyncio.gather(first, light)
        assert admission.running == 0

    asyncio.run(scenario())


async def _call(
    app: Any, path: str, middleware: ShapedProxyErrors | None = None
) -> tuple[list[dict[str, Any]], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await (middleware or ShapedProxyErrors(app))({"type": "http", "path": path}, receive, send)
    return sent, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error_chunk_and_done() -> None:
    async def cut(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        # The replica died: the proxy logs the RayActorError and returns without finishing the body.

    sent, body = asyncio.run(_call(cut, "/v1/completions"))
    chunks = [line for line in body.decode().split("\n\n") if line]
    assert chunks[-1] == "data: [DONE]"
    assert json.loads(chunks[-2].removeprefix("data: "))["error"]["code"] == "service_unavailable"
    assert sent[-1]["more_body"] is False


def test_no_answer_or_a_plain_text_503_becomes_a_shaped_503() -> None:
    async def silent(scope: Any, receive: Any, send: Any) -> None:
        return None

    async def plain(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b"No replicas", "more_body": False})

    for app in (silent, plain):
        sent, body = asyncio.run(_call(app, "/v1/chat/completions"))
        assert sent[0]["status"] == 503
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_other_routes_pass_through_untouched() -> None:
    async def silent(scope: Any, receive: Any, send: Any) -> None:
        return None

    sent, _ = asyncio.run(_call(silent, "/other-app/route"))
    assert sent == []


def test_health_answers_503_when_no_replica_answers_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_errors, "HEALTH_DEADLINE_S", 0.05)
    replica_up = True

    async def replica(scope: Any, receive: Any, send: Any) -> None:
        if not replica_up:
            await asyncio.sleep(3600)  # the proxy waiting for a replacement replica
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}', "more_body": False})

    middleware = ShapedProxyErrors(replica)
    sent, _ = asyncio.run(_call(replica, "/health", middleware))
    assert sent[0]["status"] == 200
    replica_up = False  # it died; once one answered, the proxy waits HEALTH_DEADLINE_S for another
    sent, body = asyncio.run(_call(replica, "/health", middleware))
    assert sent[0]["status"] == 503 and json.loads(body)["error"]["code"] == "unhealthy"


def test_health_says_loading_within_a_second_while_the_app_deploys() -> None:
    async def no_route(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": b"Path '/health' not found.", "more_body": False})

    async def loading(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(3600)  # the replica's constructor is loading the model

    for app in (no_route, loading):
        started = time.monotonic()
        sent, body = asyncio.run(_call(app, "/health"))
        assert time.monotonic() - started < 1.0
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        error = json.loads(body)["error"]
        assert error["code"] == "loading" and error["message"].startswith("loading: ")
        assert len([m for m in sent if m["type"] == "http.response.start"]) == 1


def test_loading_probes_are_left_running_not_cancelled() -> None:
    """Serve's proxy logs a traceback for each request cancelled while it waits for a replica: a probe
    that misses the loading deadline runs on instead, and later probes are answered without another."""
    calls: list[str] = []
    up = asyncio.Event()

    async def replica(scope: Any, receive: Any, send: Any) -> None:
        calls.append("called")
        try:
            await up.wait()
        except asyncio.CancelledError:
            calls.append("cancelled")
            raise
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}', "more_body": False})

    async def scenario() -> None:
        middleware = ShapedProxyErrors(replica)
        for _ in range(3):
            sent, _ = await _call(replica, "/health", middleware)
            assert sent[0]["status"] == 503
        assert calls == ["called"]  # one probe waits for the replica; none was cancelled
        up.set()
        await asyncio.sleep(0.01)
        assert middleware.replica_answered  # its answer (dropped) told the proxy a replica is up
        sent, _ = await _call(replica, "/health", middleware)
        assert sent[0]["status"] == 200 and calls == ["called", "called"]

    asyncio.run(scenario())


def test_health_answers_within_a_second_while_a_dead_replica_is_replaced() -> None:
    """After a replica has answered and died, each probe answers 503 `unhealthy` within a second with
    the default deadline, and the one probe waiting for the new replica is left running, not cancelled."""
    calls: list[str] = []
    up = asyncio.Event()
    up.set()

    async def replica(scope: Any, receive: Any, send: Any) -> None:
        calls.append("called")
        try:
            await up.wait()
        except asyncio.CancelledError:
            calls.append("cancelled")
            raise
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}', "more_body": False})

    async def scenario() -> None:
        middleware = ShapedProxyErrors(replica)
        sent, _ = await _call(replica, "/health", middleware)
        assert sent[0]["status"] == 200
        up.clear()  # the replica died; Serve holds requests until its replacement serves
        for _ in range(3):
            started = time.monotonic()
            sent, body = await _call(replica, "/health", middleware)
            assert time.monotonic() - started < 1.0
            error = json.loads(body)["error"]
            assert sent[0]["status"] == 503 and error["code"] == "unhealthy", error
        assert calls == ["called", "called"]  # one probe waits for the new replica; none cancelled
        up.set()
        await asyncio.sleep(0.01)
        sent, _ = await _call(replica, "/health", middleware)
        assert sent[0]["status"] == 200

    asyncio.run(scenario())
