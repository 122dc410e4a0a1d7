"""Tool-call parsing and formatting, and the request checks of structured outputs, logit_bias and the
OpenAI fields we refuse (with the service over a fake replica: no model runs)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.protocol.jobs import ChoiceDelta
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest
from tandem.deploy.protocol.responses import ChatFormat, ChoiceResult
from tandem.deploy.protocol.tool_calls import (
    ToolCallStream,
    ToolMode,
    parse_auto,
    parse_hermes,
    parse_llama3_json,
)

from ..fakes import FakeReplica, make_service


def run(coro: Any) -> Any:
    return asyncio.run(coro)


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [{"role": "user", "content": "hi"}]


def test_hermes_and_llama3_parsers() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"})
    ]
    content, calls = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b"}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert parse_auto("just words {not json")[1] == []
    assert parse_hermes("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_required_schema_accepts_only_calls_of_the_tools() -> None:
    other = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}
    mode = ToolMode([WEATHER, other], "required", parallel=False)
    constraint = mode.constraint()
    assert constraint is not None and isinstance(constraint.json, dict)
    schema = constraint.json
    jsonschema.validate([{"name": "weather", "parameters": {"city": "x"}}], schema)
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = mode.parse('[{"name": "time", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("time", "{}")]


def test_named_call_streams_its_arguments_and_the_response_carries_tool_calls() -> None:
    mode = ToolMode([WEATHER], "named", "weather")
    stream = ToolCallStream(mode)
    pieces = ['{"city', '": "Oslo"}', ""]
    bodies = [stream.delta(p, "stop" if i == 2 else None) for i, p in enumerate(pieces)]
    first = bodies[0][0]
    assert first is not None and first["tool_calls"][0]["function"]["name"] == "weather"
    args = "".join(b["tool_calls"][0]["function"]["arguments"] for b, _ in bodies if b is not None)
    assert json.loads(args) == {"city": "Oslo"} and bodies[-1][1] == "tool_calls"

    fmt = ChatFormat("id", "m", 0, tools=mode)
    result = ChoiceResult(0)
    result.add(ChoiceDelta(0, text='{"city": "Oslo"}', token_ids=[1], finish_reason="stop"))
    choice = fmt.response([result], {})["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    service, _ = make_service()
    out: dict[str, Any] = run(service.chat_completions(ChatCompletionRequest.model_validate(body)))
    return out


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        ({"audio": {"voice": "x"}}, "audio", "unsupported_parameter"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "unsupported_parameter"),
        ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "invalid_value"),  # beyond the vocabulary
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "invalid_value",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
            "invalid_value",
        ),
        ({"tool_choice": "required", "tools": [WEATHER], "guided_json": {}}, "guided_json", "invalid_value"),
    ],
)
def test_refused_fields_are_400s_naming_them(extra: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(OpenAIError) as info:
        _chat({"messages": CHAT, "max_tokens": 2, **extra})
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_neutral_values_keep_working() -> None:
    neutral = {
        "tools": [],
        "response_format": {"type": "text"},
        "logit_bias": {},
        "best_of": 1,
        "modalities": ["text"],
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
    }
    assert _chat({"messages": CHAT, "max_tokens": 2, **neutral})["choices"][0]["finish_reason"] == "length"
    service, _ = make_service()
    body = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}, "logit_bias": {}}
    assert run(service.completions(CompletionRequest.model_validate(body)))["choices"]


def test_history_with_tool_calls_reaches_the_template() -> None:
    service, replica = make_service()
    replica.max_model_len = 1024  # the tools' system turn is long for the fake's context
    replica.validate = lambda ids, sampling: None  # type: ignore[method-assign]  # its token-13 rule
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"messages": messages, "tools": [WEATHER], "max_tokens": 2}
    run(service.chat_completions(ChatCompletionRequest.model_validate(body)))
    rendered = replica.tokenizer.decode(replica.prompts[-1])
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert (
        "<tool_response>sunny</tool_response>" in rendered
        and '"name": "weather"' in rendered.split("</tools>")[0]
    )


def test_auto_streams_content_until_a_call_may_begin() -> None:
    stream = ToolCallStream(ToolMode([WEATHER], "auto"))
    call = '_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    steps = [stream.delta(t, None) for t in ("Sure. ", "<tool", call)] + [stream.delta("", "stop")]
    assert steps[0] == ({"content": "Sure. "}, None) and steps[1] == (None, None) == steps[2]
    body, reason = steps[3]
    assert reason == "tool_calls" and body is not None and "content" not in body
    assert body["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    plain = ToolCallStream(ToolMode([WEATHER], "auto"))
    assert [plain.delta(t, None)[0] for t in ("Hi", " there")] == [{"content": "Hi"}, {"content": " there"}]
    assert plain.delta("", "stop") == (None, "stop")
    held = ToolCallStream(ToolMode([WEATHER], "auto"))  # JSON that is not a call is sent at the end
    assert held.delta("{1}", None) == (None, None) and held.delta("", "length") == (
        {"content": "{1}"},
        "length",
    )


class ToolReplica(FakeReplica):
    """A long context, and no unlucky token: tool prompts are long and hold every id."""

    def __init__(self, script: list[str] | None = None) -> None:
        super().__init__(max_model_len=2048, script=script)

    def validate(self, prompt_token_ids: list[int], sampling: Any) -> None:
        sampling.validate()


def test_the_servers_tool_call_parser_is_the_only_format_read() -> None:
    """`--tool-call-parser` (vLLM's flag): a reply in another format stays content; unset, each is tried."""
    hermes_reply = ["<tool_call>", '{"name": "weather", "arguments": {"city": "Paris"}}', "</tool_call>"]
    body = {"messages": CHAT, "tools": [WEATHER], "max_tokens": 3}
    calls = {}
    for parser in (None, "hermes", "llama3_json"):
        replica = ToolReplica(script=list(hermes_reply))
        service, _ = make_service(replica, tool_call_parser=parser)
        out = run(service.chat_completions(ChatCompletionRequest.model_validate(body)))
        calls[parser] = out["choices"][0]["message"].get("tool_calls")
    assert calls[None] and calls["hermes"] and calls[None][0]["function"]["name"] == "weather"
    assert calls["llama3_json"] is None


def test_auto_tool_choice_off_is_a_400_naming_tool_choice() -> None:
    service, _ = make_service(ToolReplica(), enable_auto_tool_choice=False)
    with pytest.raises(OpenAIError) as info:
        run(
            service.chat_completions(
                ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [WEATHER]})
            )
        )
    assert info.value.status == 400 and info.value.param == "tool_choice"
    forced = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 2}
    assert run(service.chat_completions(ChatCompletionRequest.model_validate(forced)))["choices"]
