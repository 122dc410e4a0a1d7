"""vLLM's routes beyond OpenAI's on the replica's real FastAPI app, over the fake replica (no Ray):
`/tokenize`, `/detokenize`, `/tokenizer_info`, `/version`, `/ping`, `/v1/models/{id}` (through the
OpenAI SDK's `models.retrieve`), CORS preflights, and lm-eval's remote-tokenizer detection."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from tandem.deploy.config.version import tandem_version
from tandem.deploy.guards.auth import resolve_api_keys
from tandem.deploy.serving.http import build_http_app

from ..fakes import MODEL, FakeReplica, make_service

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def make_app(**kwargs: Any) -> tuple[Any, FakeReplica]:
    replica = FakeReplica(max_model_len=256)
    service, _ = make_service(replica)
    return build_http_app(service, **kwargs), replica


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_tokenize_a_prompt_as_completions_do() -> None:
    app, replica = make_app()
    tokenizer = replica.tokenizer
    out = call(app, "POST", "/tokenize", json={"prompt": "Hello world"}).json()
    assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256 and out["token_strs"] is None
    bare = call(app, "POST", "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    strs = call(app, "POST", "/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    # The ids a completion of the same prompt runs on.
    call(app, "POST", "/v1/completions", json={"prompt": "Hello world", "max_tokens": 1})
    assert replica.prompts[-1] == out["tokens"]


def test_tokenize_messages_as_chat_completions_render_them() -> None:
    app, replica = make_app()
    out = call(app, "POST", "/tokenize", json={"messages": CHAT}).json()
    call(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert out["tokens"] == replica.prompts[-1] and out["count"] == len(out["tokens"])
    open_turn = call(app, "POST", "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert out["tokens"][: open_turn["count"]] == open_turn["tokens"] and open_turn["count"] < out["count"]


def test_detokenize_is_the_inverse() -> None:
    app, replica = make_app()
    ids = replica.tokenizer.encode("Hello world", add_special_tokens=False)
    assert call(app, "POST", "/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    assert call(app, "POST", "/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_token": False}, 400, "add_special_token"),
        ("/tokenize", {"messages": CHAT, "prompt": "x"}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}, 400, None),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
        ("/tokenize", [1, 2], 400, None),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(path: str, body: Any, status: int, param: str | None) -> None:
    app, _ = make_app()
    response = call(app, "POST", path, json=body)
    assert response.status_code == status, response.text
    error = error_of(response)
    if param is not None:
        assert error["param"] == param, error
    not_json = call(app, "POST", path, content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and error_of(not_json)["code"] == "invalid_json"


def test_tokenizer_info_version_and_ping() -> None:
    app, replica = make_app()
    info = call(app, "GET", "/tokenizer_info").json()
    assert info["eos_token"] == replica.tokenizer.eos_token and info["chat_template"]
    assert info["model_max_length"] == 256
    assert call(app, "GET", "/version").json() == {"version": tandem_version()}
    for method in ("GET", "POST"):
        assert call(app, method, "/ping").json() == {"status": "ok"}
    sick, _ = make_service(FakeReplica(), health=["rank_unreachable"])
    response = call(build_http_app(sick), "GET", "/ping")
    assert response.status_code == 503 and "rank_unreachable" in error_of(response)["message"]


def test_the_sdk_retrieves_a_model_card() -> None:
    """`client.models.retrieve` (GET /v1/models/{id}), as an OpenAI SDK user calls it."""
    app, _ = make_app()

    async def go() -> tuple[Any, Any, Any]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        card = await client.models.retrieve(MODEL)
        listed = await client.models.list()
        try:
            await client.models.retrieve("gpt-9")
        except openai.NotFoundError as exc:
            return card, listed, exc
        raise AssertionError("an unknown model was found")

    card, listed, missing = asyncio.run(go())
    assert card.id == MODEL and card.owned_by == "tandem" and card.max_model_len == 256  # type: ignore[attr-defined]
    assert [m.max_model_len for m in listed.data] == [256]  # type: ignore[attr-defined]
    assert f"serves '{MODEL}'" in missing.message and missing.status_code == 404


def test_cors_preflight_answers_before_the_key_check() -> None:
    preflight = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    app, _ = make_app(api_keys=resolve_api_keys(["sk-1"]), allowed_origins=["https://ui.example"])
    response = call(app, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    # The request itself still needs the key; its 401 carries the header the browser needs to read it.
    keyed = call(app, "GET", "/v1/models", headers={"Origin": "https://ui.example"})
    assert keyed.status_code == 401 and keyed.headers["access-control-allow-origin"] == "https://ui.example"
    assert call(app, "POST", "/tokenize", json={"prompt": "x"}).status_code == 401  # the tokenizer: keyed too
    other = call(app, "OPTIONS", "/v1/models", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    anyone, _ = make_app(allowed_origins=["*"])
    star = call(
        anyone, "OPTIONS", "/v1/models", headers={**preflight, "Access-Control-Request-Method": "GET"}
    )
    assert star.status_code == 200 and star.headers["access-control-allow-origin"] == "*"
    closed, _ = make_app()
    assert "access-control-allow-origin" not in call(closed, "GET", "/v1/models", headers=preflight).headers


# ---- lm-eval's remote tokenizer, against a real HTTP server ------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[str, FakeReplica]]:
    """The app on a real port (lm-eval talks through `requests`), in a thread of this process."""
    app, replica = make_app()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", replica
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_lm_eval_detects_and_uses_the_remote_tokenizer(served: tuple[str, FakeReplica]) -> None:
    """lm-eval's `LocalCompletionsAPI` with its default tokenizer detection (`tokenizer_backend="auto"`)
    finds `/tokenizer_info` and `/tokenize`, and tokenizes through them as the server does."""
    pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, replica = served
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, tokenized_requests=True)
    assert lm.tokenizer_backend == "remote"
    text = "The quick brown fox"
    ids = lm.tok_encode(text)
    assert ids == replica.tokenizer.encode(text, add_special_tokens=False)
    assert lm.decode_batch([ids]) == [text]
    assert lm.eot_token_id == replica.tokenizer.eos_token_id


def test_lm_evals_detection_requests() -> None:
    """The two requests lm-eval 0.4.13's `check_remote_tokenizer_support` makes, and what it reads (for
    installs without lm-eval)."""
    app, replica = make_app()
    info = call(app, "GET", "/tokenizer_info")
    assert info.status_code == 200 and isinstance(info.json(), dict) and "eos_token" in info.json()
    probe = call(app, "POST", "/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert probe.status_code == 200 and probe.json()["tokens"] == replica.tokenizer.encode(
        "test", add_special_tokens=False
    )
