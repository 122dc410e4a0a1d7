"""OpenAI chat messages as gpt-oss's chat template takes them.

gpt-oss's template (and tandem's fallback, template.py) reads an assistant's reasoning from `thinking`,
renders one tool call per assistant message and names a tool result after the call just before it. So
an assistant's `reasoning_content` becomes `thinking`, a message with several calls becomes one message
per call, each followed by its own result (matched on `tool_call_id`), and a missing content is "".
"""

from __future__ import annotations

from typing import Any


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    position = 0
    while position < len(messages):
        message = messages[position]
        position += 1
        if message.get("role") != "assistant":
            out.append(_with_content(message))
            continue
        calls = message.get("tool_calls") or []
        if len(calls) <= 1:
            out.append(_assistant(message, calls))
            continue
        results = []
        while position < len(messages) and messages[position].get("role") == "tool":
            results.append(messages[position])
            position += 1
        out.extend(_interleaved(message, calls, results))
    return out


def _interleaved(
    message: dict[str, Any], calls: list[dict[str, Any]], results: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each call as a message of its own, followed by the result answering it; results that answer no
    call by id follow in their order."""
    by_id = {r.get("tool_call_id"): r for r in results if r.get("tool_call_id") is not None}
    used: set[int] = set()
    out: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        # The reasoning (or preamble) that led to the calls goes before the first.
        out.append(_assistant(message if i == 0 else {"role": "assistant"}, [call]))
        result = by_id.get(call.get("id"))
        if result is not None:
            out.append(_with_content(result))
            used.add(id(result))
    out.extend(_with_content(r) for r in results if id(r) not in used)
    return out


def _assistant(message: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "reasoning_content")}
    out["content"] = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if calls:
        out["tool_calls"] = calls
        # A call's template takes its analysis from either field, not both: the reasoning wins, since a
        # preamble's text is also in the history the client keeps.
        if reasoning:
            out["content"] = ""
    if reasoning:
        out["thinking"] = reasoning
    return out


def _with_content(message: dict[str, Any]) -> dict[str, Any]:
    return message if message.get("content") is not None else {**message, "content": ""}
