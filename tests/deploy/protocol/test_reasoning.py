"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): `<think>...</think>` goes to
`reasoning_content`, whole and streamed (the streamed parts add up to the whole), and tool calls and
constraints apply to what follows the reasoning."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.deploy.protocol.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from tandem.deploy.protocol.requests import ChatCompletionRequest

from ..fakes import FakeReplica, make_service

CHAT = [{"role": "user", "content": "hi"}]
REPLIES = [
    "<think>\nLet me see. 2 < 3 </thin k>\n</think>\n\nThe answer is 4.",
    "Plain answer, no thinking.",
    "<think>cut off while thinking",
    "\n<think></think>Empty thought.",
    "<to be or not>",
    "reasoning the prompt opened</think>after",
]
EXPECTED = {
    "qwen3": [
        ("\nLet me see. 2 < 3 </thin k>\n", "\n\nThe answer is 4."),
        (None, "Plain answer, no thinking."),
        ("cut off while thinking", None),
        ("", "Empty thought."),
        (None, "<to be or not>"),
        (None, "reasoning the prompt opened</think>after"),
    ],
    "deepseek_r1": [
        ("\nLet me see. 2 < 3 </thin k>\n", "\n\nThe answer is 4."),
        ("Plain answer, no thinking.", None),  # the template opened the block: no end, all reasoning
        ("cut off while thinking", None),
        ("", "Empty thought."),
        ("<to be or not>", None),
        ("reasoning the prompt opened", "after"),
    ],
}


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_and_streamed_replies_split_alike(name: str) -> None:
    fmt = REASONING_PARSERS[name]
    for reply, expected in zip(REPLIES, EXPECTED[name]):
        assert split_reasoning(fmt, reply) == expected, reply
        for size in (1, 2, 5):  # every split of the reply into deltas, tags cut anywhere
            stream = ReasoningStream(fmt)
            parts = [stream.feed(reply[i : i + size]) for i in range(0, len(reply), size)]
            parts.append(stream.finish())
            reasoning = "".join(r for r, _ in parts)
            content = "".join(c for _, c in parts)
            assert (reasoning if stream.reasoned else None, content or None) == expected, (reply, size)


def _chat(service: Any, body: dict[str, Any]) -> Any:
    request = ChatCompletionRequest.model_validate({"messages": CHAT, **body})
    return asyncio.run(service.chat_completions(request))


async def _collect(stream: Any) -> list[dict[str, Any]]:
    return [chunk async for batch in stream for chunk in batch]


def _streamed(service: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "stream": True, **body})

    async def go() -> list[dict[str, Any]]:
        return await _collect(await service.chat_completions(request))

    return asyncio.run(go())


SCRIPT = ["<thi", "nk>I should ", "call <tool_call>", " nothing yet.</th", "ink>\n\n", "<tool_call>",
          '{"name": "clock", "arguments": {"zone": "UTC"}}', "</tool_call>"]  # fmt: skip
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"  # the tools stay out of the prompt
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]


def test_reasoning_content_whole_streamed_and_tool_calls_after_it() -> None:
    replica = FakeReplica(script=SCRIPT)
    service, _ = make_service(replica, reasoning_parser="qwen3", chat_template=TEMPLATE)
    body = {"max_tokens": len(SCRIPT), "tools": TOOLS}
    whole = _chat(service, body)["choices"][0]
    message = whole["message"]
    assert message["reasoning_content"] == "I should call <tool_call> nothing yet."
    # The call inside the reasoning is not a call; the one after it is.
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["clock"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}

    chunks = _streamed(service, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["clock"]

    plain_service, _ = make_service(FakeReplica(script=SCRIPT[:5] + ["Four."]), reasoning_parser="qwen3")
    plain = _chat(plain_service, {"max_tokens": 6})["choices"][0]["message"]
    assert plain["reasoning_content"] == "I should call <tool_call> nothing yet."
    assert plain["content"] == "\n\nFour."
    streamed = _streamed(plain_service, {"max_tokens": 6})
    deltas = [c["choices"][0]["delta"] for c in streamed if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nFour."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == plain["reasoning_content"]
    without, _ = make_service(FakeReplica(script=SCRIPT[:5] + ["Four."]))
    assert "reasoning_content" not in _chat(without, {"max_tokens": 6})["choices"][0]["message"]


def test_constraints_start_after_the_end_of_thinking_token() -> None:
    replica = FakeReplica(script=["x"] * 4)
    replica.tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    end = replica.tokenizer.convert_tokens_to_ids("</think>")
    service, _ = make_service(replica, reasoning_parser="deepseek_r1")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    _chat(service, {"max_tokens": 4, "response_format": fmt})
    assert replica.samplings[-1].structured_outputs is not None
    assert replica.samplings[-1].structured_outputs.after_token == end
    plain, plain_replica = make_service(FakeReplica(script=["x"] * 4))
    _chat(plain, {"max_tokens": 4, "response_format": fmt})
    assert plain_replica.samplings[-1].structured_outputs.after_token is None  # no parser: from the start
