"""API keys, request bounds, server-chosen chat templates and the drain gate, on the replica's real
FastAPI app over ASGI (no Ray): a small scripted replica stands in for the ranks. Weighted admission is
tested in test_admission.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.deploy.config.args import AppArgs
from tandem.deploy.generation.service import INLINE_TOKENIZE_CHARS
from tandem.deploy.guards.auth import ApiKeys, resolve_api_keys
from tandem.deploy.guards.body_limit import BodyLimitMiddleware
from tandem.deploy.guards.limits import RequestLimits
from tandem.deploy.protocol.templates import load_chat_template
from tandem.deploy.serving.http import build_http_app

from ..fakes import FakeReplica, make_service

KEYS = ["sk-first", "sk-second"]


def make_app(
    keys: ApiKeys | None = None,
    max_body_bytes: int | None = None,
    limits: RequestLimits | None = None,
    chat_template: str | None = None,
) -> tuple[Any, FakeReplica]:
    replica = FakeReplica(max_model_len=256)
    service, _ = make_service(replica, limits=limits, chat_template=chat_template)
    return build_http_app(service, keys, max_body_bytes), replica


async def _request(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def request(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return asyncio.run(_request(app, method, path, **kwargs))


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


# ---- API keys ---------------------------------------------------------------------------------------

COMPLETION = {"prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": "Basic c2stZmlyc3Q6"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer sk-first extra"},
        {"Authorization": "sk-first"},
    ],
)
def test_v1_without_a_valid_key_is_401(headers: dict[str, str]) -> None:
    app, replica = make_app(ApiKeys(KEYS))
    for method, path, body in [("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None)]:
        response = request(app, method, path, json=body, headers=headers)
        assert response.status_code == 401, response.text
        error = error_of(response)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert "sk-wrong" not in response.text  # a wrong key is never echoed
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert replica.prompts == []


def test_every_configured_key_works_and_health_stays_open() -> None:
    app, _ = make_app(ApiKeys(KEYS))
    for key in KEYS:
        response = request(
            app, "POST", "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
    lower = request(app, "GET", "/v1/models", headers={"authorization": "bearer sk-second"})
    assert lower.status_code == 200  # the scheme is case-insensitive, as HTTP says
    assert request(app, "GET", "/health").status_code == 200
    assert request(app, "GET", "/openapi.json").status_code == 200


def test_no_key_configured_means_no_authentication() -> None:
    app, _ = make_app(ApiKeys([]))
    assert request(app, "POST", "/v1/completions", json=COMPLETION).status_code == 200


def test_keys_come_from_args_and_environment_and_never_show(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env-1, sk-env-2,")
    args = AppArgs.model_validate({"api_key": ["sk-arg"]})
    keys = resolve_api_keys(args.api_keys())
    assert len(keys) == 3
    assert all(keys.accepts(k.encode()) for k in ("sk-arg", "sk-env-1", "sk-env-2"))
    assert not keys.accepts(b"sk-env") and not keys.accepts(b"")
    for text in (repr(keys), str(keys), repr(args), str(args), args.model_dump_json()):
        assert "sk-" not in text, text
    single = AppArgs.model_validate({"api_key": "sk-one"})
    assert single.api_keys() == ["sk-one"]
    monkeypatch.delenv("TANDEM_API_KEY")
    assert not resolve_api_keys(None)


# ---- the body limit -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_from_its_headers_alone() -> None:
    app, replica = make_app(max_body_bytes=1 << 20)
    body = json.dumps({"prompt": "a" * (20 << 20)}).encode()
    start = time.monotonic()
    response = request(
        app, "POST", "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and time.monotonic() - start < 1.0
    assert error_of(response)["code"] == "request_too_large"
    assert replica.prompts == []
    assert request(app, "POST", "/v1/completions", json=COMPLETION).status_code == 200


def test_a_chunked_body_is_counted_as_it_arrives() -> None:
    seen: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(pieces: list[bytes]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        messages = [
            {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
            for i, p in enumerate(pieces)
        ]
        served = iter(messages)

        async def receive() -> dict[str, Any]:
            return next(served)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        await BodyLimitMiddleware(inner, max_bytes=100)(scope, receive, send)
        return sent

    too_big = asyncio.run(call([b"x" * 60, b"x" * 60, b"never read"]))
    assert too_big[0]["status"] == 413 and seen == []
    fits = asyncio.run(call([b"x" * 40, b"y" * 40]))
    assert fits[0]["status"] == 200 and seen == [b"x" * 40]  # the app reads the held body as sent


# ---- choices and prompt characters ----------------------------------------------------------------


def test_ten_thousand_prompts_times_128_is_400_at_once() -> None:
    app, replica = make_app(limits=RequestLimits(max_choices=512))
    body = {"prompt": ["hi"] * 10_000, "n": 128, "max_tokens": 1}
    start = time.monotonic()
    response = request(app, "POST", "/v1/completions", json=body)
    assert response.status_code == 400 and time.monotonic() - start < 1.0
    error = error_of(response)
    assert error["param"] == "n" and "1280000 choices" in error["message"]
    assert replica.prompts == []
    ok = request(app, "POST", "/v1/completions", json={"prompt": ["hi"] * 4, "n": 128, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 512


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a" * 2561}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a" * 2561]}, "prompt.1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 2000}] * 2}, "messages"),
    ],
)
def test_prompt_characters_are_bounded_before_tokenizing(path: str, body: dict[str, Any], param: str) -> None:
    app, replica = make_app(limits=RequestLimits(max_prompt_chars=2560))
    response = request(app, "POST", path, json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert replica.prompts == []


def test_long_prompts_are_tokenized_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    app, replica = make_app()
    threads: list[str] = []
    encode = replica.tokenizer.encode

    def recording_encode(text: str, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(text, **kwargs)

    monkeypatch.setattr(replica.tokenizer, "encode", recording_encode)
    short = {"prompt": "short", "max_tokens": 1}
    long = {"prompt": "ab " * (INLINE_TOKENIZE_CHARS // 3 + 1), "max_tokens": 1}
    assert request(app, "POST", "/v1/completions", json=short).status_code == 200
    assert request(app, "POST", "/v1/completions", json=long).status_code == 400  # fills the context
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("tandem-tokenize")


# ---- templates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "continue_final_message", "tools"])
def test_clients_cannot_change_the_template(key: str) -> None:
    app, replica = make_app()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {key: "{{ 7 * 7 }}", "enable_thinking": False},
    }
    response = request(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "chat_template_kwargs" and key in error["message"]
    assert replica.prompts == []


def test_the_servers_template_renders_the_chat(tmp_path: Path) -> None:
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{% if flag %}!{% endif %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    app, replica = make_app(chat_template=load_chat_template(str(path)))
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"flag": 1},
    }
    assert request(app, "POST", "/v1/chat/completions", json=body).status_code == 200
    assert replica.tokenizer.decode(replica.prompts[-1]) == "<<hi>>!"


# ---- the drain gate -------------------------------------------------------------------------------


def test_the_drain_gate_counts_requests_and_turns_new_ones_away() -> None:
    from tandem.deploy.guards.shutdown import DrainGate, GateState

    async def scenario() -> None:
        gate = GateState()
        release = asyncio.Event()

        async def slow(scope: Any, receive: Any, send: Any) -> None:  # a stream still being sent
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await release.wait()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

        transport = httpx.ASGITransport(app=DrainGate(slow, gate))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            running = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
            await asyncio.sleep(0.05)
            assert gate.in_flight == 1
            gate.close()
            late = await client.post("/v1/completions", json=COMPLETION)
            assert late.status_code == 503 and error_of(late)["code"] == "shutting_down"
            health = await client.get("/health")
            assert health.status_code == 503 and error_of(health)["message"] == "unhealthy: draining"
            waiting = asyncio.create_task(gate.wait_idle(timeout_s=5.0))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            release.set()
            assert (await running).text == "data: [DONE]\n\n"  # the request in flight finished normally
            assert await waiting and gate.in_flight == 0

    asyncio.run(scenario())


# ---- fuzzing the bounds ---------------------------------------------------------------------------

_FUZZ_APP, _FUZZ_REPLICA = make_app(
    ApiKeys(["sk-fuzz"]), max_body_bytes=4096, limits=RequestLimits(max_choices=8, max_prompt_chars=64)
)


@given(
    prompts=st.lists(st.text(max_size=80), min_size=1, max_size=6),
    n=st.integers(min_value=1, max_value=4),
    key=st.sampled_from([None, "sk-fuzz", "sk-fuz", "sk-fuzzz", ""]),
    padding=st.integers(min_value=0, max_value=6000),
)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_fuzzed_bounds_give_the_right_4xx_and_never_a_5xx(
    prompts: list[str], n: int, key: str | None, padding: int
) -> None:
    body = json.dumps({"prompt": prompts, "n": n, "max_tokens": 1, "user": "u" * padding}).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    response = request(_FUZZ_APP, "POST", "/v1/completions", content=body, headers=headers)
    if key != "sk-fuzz":
        expected = 401
    elif len(body) > 4096:
        expected = 413
    elif len(prompts) * n > 8 or any(len(p) > 64 for p in prompts):
        expected = 400
    else:
        expected = response.status_code  # within the bounds: the replica decides (200, or a 400 it owns)
        assert expected in (200, 400), response.text
    assert response.status_code == expected, (response.status_code, response.text[:200])
    if expected != 200:
        error_of(response)
