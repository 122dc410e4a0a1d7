"""Chat responses and stream chunks of a harmony model, read from the reply's token ids (parser.py).

A streamed chunk carries what its tokens added: `reasoning_content`, `content`, and `tool_calls` as
OpenAI streams them (a call's first delta has its index, id, type and name, later ones add to its
`arguments`). A whole response reads the same tokens with the same parser, so the streamed deltas of each
field add up to the response's. A reply that called a function and stopped finishes with `tool_calls`.
The request's stop strings end the fields where one begins (parser.py's `StopCut`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.deploy.protocol.harmony.parser import CallDelta, HarmonyStream, read_reply
from tandem.deploy.protocol.harmony.tokens import HarmonyTokens
from tandem.deploy.protocol.jobs import ChoiceDelta
from tandem.deploy.protocol.responses import ChatFormat, ChoiceResult
from tandem.deploy.protocol.responses import _chat_logprobs as chat_logprobs
from tandem.deploy.protocol.tool_calls import new_call_id


class HarmonyChatFormat(ChatFormat):
    def __init__(
        self, response_id: str, model: str, created: int, tokens: HarmonyTokens, stops: Sequence[str] = ()
    ) -> None:
        super().__init__(response_id, model, created)
        self._tokens = tokens
        self._stops = list(stops)  # the request's stop strings: the fields end where one begins
        self._streams: dict[int, HarmonyStream] = {}

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        stream = self._streams.get(delta.index)
        if stream is None:
            stream = self._streams[delta.index] = HarmonyStream(self._tokens, new_call_id, self._stops)
        parsed = stream.feed(delta.token_ids, last=delta.finish_reason is not None)
        body: dict[str, Any] = {}
        if parsed.reasoning:
            body["reasoning_content"] = parsed.reasoning
        if parsed.content:
            body["content"] = parsed.content
        if parsed.calls:
            body["tool_calls"] = [_streamed_call(c) for c in parsed.calls]
        finish_reason = _finish(delta.finish_reason, stream.called)
        if not body and finish_reason is None and not delta.logprobs:
            return None  # tokens of a header or a marker: nothing a client sees
        choice = {
            "index": delta.index,
            "delta": body,
            "logprobs": chat_logprobs(delta.logprobs) if delta.logprobs is not None else None,
            "finish_reason": finish_reason,
        }
        return self._envelope(self.chunk_object_name, [choice])

    def response(self, choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            reply = read_reply(self._tokens, c.token_ids, new_call_id, self._stops)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": reply.content,
                "reasoning_content": reply.reasoning,
            }
            if reply.calls:
                message["tool_calls"] = [_call(c) for c in reply.calls]
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": _finish(c.finish_reason, reply.called),
                }
            )
        response = self._envelope(self.object_name, out)
        response["usage"] = usage
        return response


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called else reason


def _call(call: CallDelta) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.call_id, "type": "function", "function": function}


def _streamed_call(call: CallDelta) -> dict[str, Any]:
    if call.call_id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, **_call(call)}
