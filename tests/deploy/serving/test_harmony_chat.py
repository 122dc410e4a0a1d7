"""Chat completions of a gpt-oss (harmony) model, in process: the real service and request path over a
replica that writes a scripted harmony reply, token by token, with the harmony tokenizer.

A tiny random model writes no harmony, so the reply is scripted at the replica's edge; everything above it
(rendering, stop tokens, reading the reply, OpenAI fields, streaming, HTTP) is the served code.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.protocol.harmony.chat import HarmonyChat
from tandem.deploy.protocol.harmony.parser import read_reply
from tandem.deploy.protocol.harmony.tokens import HarmonyTokens
from tandem.deploy.protocol.tool_calls import new_call_id
from tandem.deploy.serving.http import build_http_app
from tandem.deploy.serving.openai_service import OpenAIService

from ..fakes import MODEL, InProcessBackend
from ..harmony_fakes import HarmonyReplica
from ..harmony_tokenizer import encode

ANALYSIS = "<|channel|>analysis<|message|>They want the weather in Paris; call the tool.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>Sunny, 20°C — enjoy Paris.<|return|>"
AFTER = "<|start|>assistant<|channel|>final<|message|>never generated"  # past the stop token
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def harmony_service(reply: str) -> tuple[OpenAIService, HarmonyReplica]:
    replica = HarmonyReplica(reply)
    harmony = HarmonyChat.for_model("gpt_oss", replica.tokenizer)
    return OpenAIService(InProcessBackend(replica), MODEL, harmony=harmony), replica


def chat(service: OpenAIService, **body: Any) -> Any:
    messages = body.pop(
        "messages", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    )
    return asyncio.run(service.answer("/v1/chat/completions", {"messages": messages, **body}))


def streamed(service: OpenAIService, **body: Any) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        stream = await service.answer("/v1/chat/completions", {**body, "stream": True})
        return [chunk async for batch in stream for chunk in batch]

    return asyncio.run(go())


def test_reasoning_and_content_with_the_effort_in_the_prompt() -> None:
    service, replica = harmony_service(ANALYSIS + FINAL + AFTER)
    out = chat(service, reasoning_effort="high")
    (choice,) = out["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "reasoning_content": "They want the weather in Paris; call the tool.",
        "content": "Sunny, 20°C — enjoy Paris.",
    }
    assert choice["finish_reason"] == "stop"
    # Generation stopped at <|return|>: nothing after it was generated.
    assert out["usage"]["completion_tokens"] == len(encode(replica.tokenizer, ANALYSIS + FINAL))
    prompt = replica.tokenizer.decode(replica.prompts[-1])
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt
    assert prompt.endswith("<|start|>user<|message|>Paris?<|end|><|start|>assistant")
    chat(service)  # medium unless the request says otherwise
    assert "Reasoning: medium" in replica.tokenizer.decode(replica.prompts[-1])


def test_a_tool_call_ends_the_reply_with_finish_reason_tool_calls() -> None:
    service, replica = harmony_service(ANALYSIS + CALL + FINAL)
    out = chat(service, tools=[WEATHER])
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"].startswith("They want")
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out["usage"]["completion_tokens"] == len(encode(replica.tokenizer, ANALYSIS + CALL))
    prompt = replica.tokenizer.decode(replica.prompts[-1])
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt


def test_streamed_deltas_add_up_to_the_response() -> None:
    service, _ = harmony_service(
        ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>" + CALL
    )
    body = {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}
    whole = chat(service, **body)["choices"][0]
    chunks = streamed(service, **body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (
        reasoning == whole["message"]["reasoning_content"]
        and content == whole["message"]["content"] == "One moment."
    )
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 and set(c) == {"index", "function"} for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == whole["message"]["tool_calls"][0]["function"]["arguments"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


def test_cut_off_while_reasoning() -> None:
    service, _ = harmony_service(ANALYSIS + FINAL)
    (choice,) = chat(service, max_tokens=8)["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
    chunks = streamed(service, messages=[{"role": "user", "content": "x"}], max_tokens=8)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_requests_are_400_naming_the_param(body: dict[str, Any], param: str) -> None:
    service, replica = harmony_service(FINAL)
    with pytest.raises(OpenAIError) as caught:
        chat(service, **body)
    assert caught.value.status == 400 and caught.value.param == param
    assert replica.prompts == []


def test_over_http() -> None:
    service, _ = harmony_service(ANALYSIS + FINAL)
    transport = httpx.ASGITransport(app=build_http_app(service))
    messages = [{"role": "user", "content": "Paris?"}]

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            bad = await client.post(
                "/v1/chat/completions", json={"messages": messages, "reasoning_effort": "max"}
            )
            sse = await client.post(
                "/v1/chat/completions", json={"messages": messages, "reasoning_effort": "low", "stream": True}
            )
            return bad, sse

    bad, sse = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    events = [
        json.loads(e.removeprefix("data: ")) for e in sse.text.split("\n\n") if e and e != "data: [DONE]"
    ]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Sunny, 20°C — enjoy Paris."
    assert "".join(d.get("reasoning_content", "") for d in deltas).startswith("They want the weather")


def test_each_choice_is_read_on_its_own() -> None:
    service, _ = harmony_service(ANALYSIS + FINAL)
    chunks = streamed(service, messages=[{"role": "user", "content": "x"}], n=2)
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks[2:] if c["choices"][0]["index"] == index]
        assert "".join(d.get("content", "") for d in deltas) == "Sunny, 20°C — enjoy Paris."
    out = chat(service, n=2)
    assert [c["message"]["content"] for c in out["choices"]] == ["Sunny, 20°C — enjoy Paris."] * 2


@pytest.mark.parametrize(
    "stop, field, kept",
    [
        # Each stop string ends inside a token ("ar", "at"): the field ends where the stop begins.
        ("enjoy Pa", "content", "Sunny, 20°C — "),
        (["nothing", "the wea"], "reasoning_content", "They want "),
    ],
)
def test_stop_strings_end_the_fields_where_they_begin(stop: Any, field: str, kept: str) -> None:
    service, replica = harmony_service(ANALYSIS + FINAL)
    (choice,) = chat(service, stop=stop)["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"][field] == kept
    if field == "reasoning_content":
        assert choice["message"]["content"] is None
    # The stop's last token carried more: read without the stop strings, the field runs past them.
    generated = replica.generated[0]
    uncut = read_reply(HarmonyTokens.of(replica.tokenizer), generated, new_call_id)
    assert (uncut.content if field == "content" else uncut.reasoning) != kept
    chunks = streamed(service, messages=[{"role": "user", "content": "x"}], stop=stop)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get(field, "") for d in deltas) == kept
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_in_a_call_cuts_its_arguments_and_it_is_no_finished_call() -> None:
    service, _ = harmony_service(ANALYSIS + CALL)
    (choice,) = chat(service, tools=[WEATHER], stop='"Pa')["choices"]
    assert choice["finish_reason"] == "stop"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": '}
