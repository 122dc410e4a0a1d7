"""OpenAI response and stream-chunk dicts for both endpoints, built from `ChoiceDelta`s.

`CompletionFormat` and `ChatFormat` share one shape of interface, so the service streams or collects
either the same way: `start_chunks` (chat's role deltas), `chunk` per delta, `usage_chunk`, `response`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tandem.deploy.protocol.jobs import ChoiceDelta, TokenLogprob
from tandem.deploy.protocol.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from tandem.deploy.protocol.tool_calls import ToolCallStream, ToolMode, call_dicts, new_call_id


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` counts prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class CachedTokens:
    """Sums `cached_tokens` over a job's prompts. `prompt_tokens` counts each prompt once, not once per
    choice, so each prompt's cached count is its first choice's (index % n == 0)."""

    def __init__(self, n: int) -> None:
        self._n = max(n, 1)
        self.total = 0

    def add(self, delta: ChoiceDelta) -> None:
        if delta.cached_tokens is not None and delta.index % self._n == 0:
            self.total += delta.cached_tokens


@dataclass
class ChoiceResult:
    """One choice, accumulated for a non-streaming response."""

    index: int
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # what a harmony reply is read from
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    text_offsets: list[int] = field(default_factory=list)
    _next_offset: int = field(default=0, init=False, repr=False)

    def add(self, delta: ChoiceDelta) -> None:
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            offsets, self._next_offset = _offsets(self._next_offset, delta.logprobs)
            self.text_offsets.extend(offsets)
            self.logprobs.extend(delta.logprobs)
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def _offsets(base: int, entries: list[TokenLogprob]) -> tuple[list[int], int]:
    # Where each token's text starts: the running sum of the token strings before it, as vLLM counts it.
    # It is not measured on the detokenized text, whose length at a delta's start depends on how the
    # tokens happened to be grouped into deltas (bytes of one character are held back until it is
    # whole), so the same tokens would get other offsets streamed, unstreamed or under other load.
    offsets, position = [], base
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    return offsets, position


class _Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, created: int) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self._next_offsets: dict[int, int] = {}  # per choice, for streamed text offsets

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [])
        chunk["usage"] = usage
        return chunk

    def _streamed_offsets(self, delta: ChoiceDelta) -> list[int]:
        offsets, self._next_offsets[delta.index] = _offsets(
            self._next_offsets.get(delta.index, 0), delta.logprobs or []
        )
        return offsets


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def start_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        offsets = self._streamed_offsets(delta)
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None  # nothing a client could see (e.g. text held back for a possible stop string)
        logprobs = _completion_logprobs(delta.logprobs, offsets) if delta.logprobs is not None else None
        choice = {
            "index": delta.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
        return self._envelope(self.chunk_object_name, [choice])

    def response(self, choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        out = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(c.logprobs, c.text_offsets)
                if c.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        response = self._envelope(self.object_name, out)
        response["usage"] = usage
        return response


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        tools: ToolMode | None = None,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        super().__init__(response_id, model, created)
        # With tools (other than tool_choice "none") replies are read for calls (tool_calls.py).
        self._tools = tools if tools is not None and tools.choice != "none" else None
        self._tool_streams: dict[int, ToolCallStream] = {}
        # With a reasoning parser, `<think>...</think>` goes to reasoning_content, the rest on as content.
        self._reasoning = reasoning
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def start_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        # OpenAI opens each choice with a delta that carries only the role.
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(num_choices)
        ]

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, delta = self._split(self._reasoning, delta)
        if self._tools is not None:
            chunk = self._tool_chunk(self._tools, delta)
            if reasoning:
                chunk = chunk or self._envelope(
                    self.chunk_object_name,
                    [{"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": None}],
                )
                choice = chunk["choices"][0]
                choice["delta"] = {"reasoning_content": reasoning, **choice["delta"]}
            return chunk
        if not delta.text and not reasoning and delta.finish_reason is None and not delta.logprobs:
            return None
        body: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if delta.text or (delta.logprobs and not reasoning):
            body["content"] = delta.text
        logprobs = _chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
        choice = {
            "index": delta.index,
            "delta": body,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
        return self._envelope(self.chunk_object_name, [choice])

    def _split(self, fmt: ReasoningFormat, delta: ChoiceDelta) -> tuple[str, ChoiceDelta]:
        """The delta's new reasoning, and the delta with only its new content left as text."""
        stream = self._reasoning_streams.setdefault(delta.index, ReasoningStream(fmt))
        reasoning, content = stream.feed(delta.text)
        if delta.finish_reason is not None:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, replace(delta, text=content)

    def _tool_chunk(self, tools: ToolMode, delta: ChoiceDelta) -> dict[str, Any] | None:
        stream = self._tool_streams.setdefault(delta.index, ToolCallStream(tools))
        body, finish_reason = stream.delta(delta.text, delta.finish_reason)
        if body is None and finish_reason is None:
            return None
        choice = {"index": delta.index, "delta": body or {}, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(self.chunk_object_name, [choice])

    def _message(self, c: ChoiceResult) -> tuple[dict[str, Any], str | None]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        text = c.text
        if self._reasoning is not None:
            reasoning, content = split_reasoning(self._reasoning, c.text)
            message["reasoning_content"] = reasoning
            message["content"] = content
            text = content or ""
        if self._tools is None:
            return message, c.finish_reason
        content, calls = self._tools.parse(text)
        if not calls:
            return message, c.finish_reason
        message["content"] = content
        message["tool_calls"] = call_dicts(calls, [new_call_id() for _ in calls])
        return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason

    def response(self, choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            message, finish_reason = self._message(c)
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": _chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": finish_reason,
                }
            )
        response = self._envelope(self.object_name, out)
        response["usage"] = usage
        return response


def _completion_logprobs(entries: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    top: list[dict[str, float] | None] = []
    for entry in entries:
        if entry.logprob is None:  # an echoed prompt's first token: nothing scored it
            top.append(None)
            continue
        alternatives = dict(entry.top)
        alternatives.setdefault(entry.token, entry.logprob)  # the sampled token is always listed
        top.append(alternatives)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode("utf-8")),
            "top_logprobs": [
                {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))} for text, lp in e.top
            ],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}
