"""Structured outputs, tool calls, logit_bias and refused fields on a real Ray Serve app (CPU), through
the official SDK. The tiny model has random weights: only real constrained decoding can make its
outputs parse and validate. One app for the whole module."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "maximum": 4}},
            "required": ["kind", "legs"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "pet", "ok"],
}
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "pattern": "^(metric|imperial)$"},
    },
    "required": ["city", "days", "units"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
CHAT = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-structured",
        "device": "cpu",
        "engine": {"page_size": 4},
        "max_ongoing_requests": 64,
    }
    with serve_app_context(args, name="tandem-structured") as running:
        yield running


@pytest.fixture(scope="module")
def client(app: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def aclient(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_json_schema_over_30_seeds_mixed_with_plain_requests(app: Any, client: openai.OpenAI) -> None:
    model = app.served_model_name
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    prompts = ["Once upon a time", "The list of numbers"]
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
        for p in prompts
    ]

    async def run_all() -> tuple[list[Any], list[str]]:
        async with aclient(app) as ac:
            schema_calls = [
                ac.chat.completions.create(
                    model=model, messages=CHAT, response_format=fmt, seed=s, temperature=1.0, max_tokens=96
                )
                for s in range(30)
            ]
            plain_calls = [
                ac.completions.create(model=model, prompt=p, max_tokens=16, temperature=0) for p in prompts
            ]
            results = await asyncio.gather(*schema_calls, *plain_calls)
        return list(results[:30]), [r.choices[0].text for r in results[30:]]

    constrained, plain = asyncio.run(run_all())
    assert plain == alone  # plain rows batched with grammar rows still give their greedy outputs
    for out in constrained:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    # /v1/completions takes response_format too.
    text = client.completions.create(
        model=model, prompt="person:", max_tokens=96, seed=3, extra_body={"response_format": fmt}
    ).choices[0]
    jsonschema.validate(json.loads(text.text), SCHEMA)


def test_json_object_and_vllm_fields(app: Any, client: openai.OpenAI) -> None:
    model = app.served_model_name
    out = client.completions.create(
        model=model,
        prompt="json:",
        max_tokens=32,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(out.choices[0].text), dict), out.choices[0].text
    picked = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, extra_body={"guided_choice": ["sunny", "rainy"]}
    )
    assert picked.choices[0].message.content in ("sunny", "rainy")
    digits = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    content = digits.choices[0].message.content or ""
    assert len(content) == 4 and content.isdigit()
    # The handle API takes the same bodies.
    body = {"messages": CHAT, "max_tokens": 8, "guided_choice": ["yes", "no"]}
    handled = app.handle.chat_completions.remote(body).result(timeout_s=60)
    assert handled["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_tool_calls_validate_and_stream_the_same_call(
    app: Any, client: openai.OpenAI, choice: Any
) -> None:
    kwargs: dict[str, Any] = {
        "model": app.served_model_name,
        "messages": CHAT,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 80,
        "seed": 7,
        "temperature": 1.0,
    }
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["weather"]

    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                if delta.function is not None and delta.function.name:
                    names[delta.index] = delta.function.name
                if delta.function is not None and delta.function.arguments:
                    arguments[delta.index] = arguments.get(delta.index, "") + delta.function.arguments
    assert finish == "tool_calls"
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
    ]


def test_tool_history_is_accepted(app: Any, client: openai.OpenAI) -> None:
    messages: list[Any] = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "clock", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = client.chat.completions.create(
        model=app.served_model_name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logit_bias_forces_a_token(app: Any, client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=app.served_model_name,
        prompt="hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        logprobs=0,
    )
    assert out.usage is not None and out.usage.completion_tokens == 4
    # The SDK's logprobs give the tokens' text; token 42 is one byte-level symbol repeated.
    tokens = out.choices[0].logprobs.tokens if out.choices[0].logprobs else None
    assert tokens is not None and len(set(tokens)) == 1


def test_rejected_schema_and_unsupported_field_are_400s(app: Any, client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=app.served_model_name,
            messages=CHAT,
            max_tokens=4,
            response_format=bad,  # type: ignore[arg-type]
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "response_format", error
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=app.served_model_name, messages=CHAT, max_tokens=4, modalities=["audio"]
        )
    error = info.value.body
    assert isinstance(error, dict) and (error["param"], error["code"]) == (
        "modalities",
        "unsupported_parameter",
    )


def test_sdk_parse_of_a_pydantic_model_with_bounded_strings(app: Any) -> None:
    """The SDK's parse(): it sends the model's strict schema (bounded strings among its fields) and
    parses the reply back into the model, which fails on any JSON a strict parser refuses."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        code: str = Field(min_length=2, max_length=4)
        visited: bool

    async def one(seed: int) -> tuple[str | None, Any]:
        async with aclient(app) as client:
            reply = await client.chat.completions.parse(
                model=app.served_model_name, messages=CHAT, response_format=City, temperature=1.0,
                seed=seed, max_tokens=120,
            )  # fmt: skip
        choice = reply.choices[0]
        return choice.finish_reason, choice.message.parsed

    async def all_of() -> list[tuple[str | None, Any]]:
        return list(await asyncio.gather(*(one(seed) for seed in range(8))))

    results = asyncio.run(all_of())
    parsed = [value for reason, value in results if reason == "stop"]
    assert len(parsed) >= 6, results
    for value in parsed:
        assert isinstance(value, City) and len(value.name) <= 12 and 2 <= len(value.code) <= 4
