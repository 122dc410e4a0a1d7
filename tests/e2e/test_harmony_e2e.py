"""A tiny gpt-oss served by the real app (Ray Serve on loopback, the real LLMReplica and engine): chats
are rendered as harmony, stopped at <|return|> and <|call|>, and read by channel. One app for the module.

A tiny random model writes no harmony, so these tests check the protocol and the shape of what comes
back, not its content: the prompt's tokens (counted in `usage`) are the harmony rendering with the
request's effort, and a forced <|return|> or <|call|> ends the reply although neither is the model's eos.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tandem.deploy.protocol.harmony.messages import harmony_messages
from tandem.deploy.protocol.harmony.template import HARMONY_TEMPLATE

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes."}]
MESSAGE_KEYS = {"role", "content", "reasoning_content", "tool_calls", "refusal", "annotations", "audio"}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_dir("gpt_oss"))


@pytest.fixture(scope="module")
def app(serve_app_context, model_dir: Path) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {"model": str(model_dir), "served_model_name": "tiny-gpt-oss", "device": "cpu"}
    with serve_app_context(args) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def post(app: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/chat/completions", json=body, timeout=120)


def stream_chunks(app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{app.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def harmony_prompt_len(tokenizer: Any, effort: str) -> int:
    text = tokenizer.apply_chat_template(
        harmony_messages(CHAT),
        chat_template=HARMONY_TEMPLATE,  # the tiny gpt-oss ships no template: the server uses tandem's
        tokenize=False,
        add_generation_prompt=True,
        reasoning_effort=effort,
    )
    assert "<|start|>system<|message|>" in text and f"Reasoning: {effort}" in text
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_with_reasoning_effort_is_rendered_as_harmony(app: Any, tokenizer: Any) -> None:
    assert tokenizer.chat_template is None
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    for effort in ("low", "high"):
        out = client.chat.completions.create(
            model=app.served_model_name,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            reasoning_effort=effort,  # type: ignore[arg-type]
        )
        (choice,) = out.choices
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert set(choice.message.model_dump()) <= MESSAGE_KEYS | {"function_call"}
        assert "reasoning_content" in (choice.message.model_extra or {})
        assert out.usage is not None and out.usage.prompt_tokens == harmony_prompt_len(tokenizer, effort)
        assert 1 <= out.usage.completion_tokens <= 8


@pytest.mark.parametrize("marker", ["<|return|>", "<|call|>"])
def test_return_and_call_end_the_reply(app: Any, tokenizer: Any, marker: str) -> None:
    forced = tokenizer.convert_tokens_to_ids(marker)
    body = {"messages": CHAT, "max_tokens": 6, "logit_bias": {str(forced): 100}}
    out = post(app, body)
    assert out.status_code == 200, out.text
    (choice,) = out.json()["choices"]
    assert choice["finish_reason"] == "stop" and out.json()["usage"]["completion_tokens"] == 1
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] is None
    # Not the model's eos: with ignore_eos the same reply runs on to max_tokens.
    longer = post(app, {**body, "ignore_eos": True}).json()
    assert longer["choices"][0]["finish_reason"] == "length" and longer["usage"]["completion_tokens"] == 6
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(app, streamed)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


def test_streamed_chat_has_the_same_shape_and_usage(app: Any, tokenizer: Any) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "reasoning_effort": "medium",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = stream_chunks(app, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) <= {"content", "reasoning_content", "tool_calls"} for d in deltas[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) <= {None}
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == harmony_prompt_len(tokenizer, "medium")
    whole = post(app, {**body, "stream": False, "stream_options": None}).json()
    assert whole["usage"] == usage  # greedy: the same reply
    message = whole["choices"][0]["message"]
    for field in ("content", "reasoning_content"):
        assert "".join(d.get(field) or "" for d in deltas[1:]) == (message[field] or "")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_harmony_cannot_serve_is_a_400(app: Any, extra: dict[str, Any], param: str) -> None:
    out = post(app, {"messages": CHAT, **extra})
    assert out.status_code == 400 and out.json()["error"]["param"] == param
