"""Tool calling: the constraint a forced call decodes under, the parsers of models' own call formats,
and the OpenAI `tool_calls` a choice's text becomes (whole, or as streamed deltas).

- `tool_choice` "required": the output is a JSON array of {"name", "parameters"} objects, each item
  under the schema of one of the tools, so every call names a tool and its arguments validate.
- a named function: the output is that function's arguments, under its `parameters` schema.
- "auto": the model writes calls in its own format, which a parser of `PARSERS` finds in the text.
- "none": tools are shown to the template, nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.deploy.protocol.structured_fields import ToolFields
from tandem.scheduler.sampling_params import StructuredOutputs


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


# text -> (the content outside the calls, or None when there is none; the calls found)
ToolParser = Callable[[str], tuple[str | None, list[ParsedCall]]]


def _call_from(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call_from(json.loads(body))
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Llama 3.1's JSON form: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
    several separated by `;`."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        call = _call_from(obj)
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\n;":
            position += 1
    return None, calls


PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_auto(text: str, parser_name: str | None = None) -> tuple[str | None, list[ParsedCall]]:
    """The calls of the first parser in `PARSERS` (or of the one named) that finds any; else the text is
    all content."""
    parsers = PARSERS.values() if parser_name is None else [PARSERS[parser_name]]
    for parser in parsers:
        content, calls = parser(text)
        if calls:
            return content, calls
    return text, []


@dataclass(frozen=True)
class ToolMode:
    """A chat request's tools and how the reply is read."""

    tools: list[dict[str, Any]]  # OpenAI tool dicts, as the chat template takes them
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function of "named"
    parallel: bool = True
    parser: str | None = None  # "auto": the one format of `PARSERS` to read (the server's --tool-call-parser)

    def constraint(self) -> StructuredOutputs | None:
        """The schema a forced call decodes under; None for "auto" and "none"."""
        params = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools
        }
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutputs(json=params[self.name])
        if self.choice != "required":
            return None
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
                for name, schema in params.items()
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=array)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished choice's text."""
        if self.choice == "named":
            assert self.name is not None
            return None, [ParsedCall(self.name, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens
                return text, []
            found = [_call_from(item) for item in items] if isinstance(items, list) else []
            return None, [c for c in found if c is not None]
        if self.choice == "auto":
            content, calls = parse_auto(text, self.parser)
            return content, calls if self.parallel else calls[:1]
        return text, []


def tool_mode(req: ToolFields) -> ToolMode | None:
    """The request's ToolMode, None without tools; a ValueError naming a tool_choice that is unknown."""
    if not req.tools:
        if isinstance(req.tool_choice, str) and req.tool_choice in ("required",):
            raise ValueError("tool_choice 'required' needs tools")
        if req.tool_choice is not None and not isinstance(req.tool_choice, str):
            raise ValueError("a named tool_choice needs tools")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):
        return ToolMode(tools, choice, parallel=parallel)
    if choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
    return ToolMode(tools, "named", choice.function.name, parallel)


def call_dicts(calls: list[ParsedCall], ids: list[str]) -> list[dict[str, Any]]:
    return [
        {"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, call_id in zip(calls, ids)
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_CALL_STARTS = ("<tool_call>", "<|python_tag|>", "{")


def _held_from(text: str) -> int:
    """Where the part of `text` that may be (the start of) a tool call begins; len(text) if none.

    A Llama 3.1 JSON call is the whole reply, so it can only start the text; a Hermes call may follow
    content, so a trailing partial `<tool_call>` is held too.
    """
    stripped = text.lstrip()
    if any(s.startswith(stripped) or stripped.startswith(s) for s in _CALL_STARTS):
        return 0
    found = text.find("<tool_call>")
    if found >= 0:
        return found
    for length in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-length:]):
            return len(text) - length
    return len(text)


@dataclass
class ToolCallStream:
    """One choice's streamed reply under a ToolMode: `delta` maps each text delta to the chat delta
    body to send (None: nothing yet) and the finish reason to report.

    A named function's arguments stream as they come (the first delta names the call). "auto" streams
    its content up to where a call may begin and holds the rest; "required" holds everything. What is
    held is parsed when the choice ends, since a call is only known whole.
    """

    mode: ToolMode
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content ("auto")
    call_id: str = field(default_factory=new_call_id)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        first = not self.text
        self.text += text
        if self.mode.choice == "auto" and finish_reason is None:
            release = _held_from(self.text)
            if release <= self.sent:
                return None, None
            released, self.sent = self.text[self.sent : release], release
            return {"content": released}, None
        if self.mode.choice == "named":
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
            if not text:
                return None, reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {
                    "index": 0,
                    "id": self.call_id,
                    "type": "function",
                    "function": {"name": self.mode.name, "arguments": text},
                }
            return {"tool_calls": [call]}, reason
        if finish_reason is None:
            return None, None
        content, calls = self.mode.parse(self.text)
        if not calls:
            content = self.text
        body: dict[str, Any] = {}
        if content and len(content) > self.sent and content.startswith(self.text[: self.sent]):
            body["content"] = content[self.sent :]  # what was not streamed yet
        if calls:
            ids = [new_call_id() for _ in calls]
            body["tool_calls"] = [{"index": i, **d} for i, d in enumerate(call_dicts(calls, ids))]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return body or None, finish_reason
