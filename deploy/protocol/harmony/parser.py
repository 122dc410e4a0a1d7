"""Reading a harmony reply: a state machine over the harmony special-token ids, with the text between them
decoded incrementally.

A reply is a run of messages. The prompt ends with `<|start|>assistant`, so the first message's header
is already open; every later one starts with `<|start|>`. A header (`assistant<|channel|>analysis`,
`<|channel|>commentary to=functions.get_weather <|constrain|>json`) ends at `<|message|>`, its body at
`<|end|>`, or at `<|return|>` / `<|call|>`, which end the reply. What each message becomes:

- channel `analysis`, or a recipient other than `functions.*` (a built-in tool): `reasoning_content`;
- a recipient `functions.NAME`: a tool call of NAME whose arguments are the body;
- channel `final`, a `commentary` preamble without recipient, anything else: `content`.

Token boundaries never matter: a header is read whole at its `<|message|>`, and body text goes through a
`DecodeStream`, which holds the bytes of a character split over tokens until it is whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from tokenizers.decoders import DecodeStream

from tandem.deploy.protocol.harmony.tokens import HarmonyTokens

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
FUNCTIONS = "functions."

Part = Literal["reasoning", "content", "call"]


@dataclass
class CallDelta:
    """New output of one tool call: its first delta carries the id and the name."""

    index: int
    arguments: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass
class HarmonyDelta:
    """What a run of tokens added to the reply, by field."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


def read_header(header: str) -> tuple[Part, str | None]:
    """The part a message with this header feeds, and the function it calls (for "call")."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
        return "call", recipient.group(1)[len(FUNCTIONS) :]
    channel = _CHANNEL.search(header)
    if recipient is not None or (channel is not None and channel.group(1) == "analysis"):
        return "reasoning", None
    return "content", None


class HarmonyStream:
    """One choice's reply, fed token ids as they come; each `feed` returns what they added.

    `called` says whether the reply addressed a function, which makes a `stop` a `tool_calls` finish.
    """

    def __init__(self, tokens: HarmonyTokens, new_call_id: Callable[[], str]) -> None:
        self._tokens = tokens
        self._new_call_id = new_call_id
        self._state: Literal["header", "body", "between", "done"] = "header"
        self._header: list[int] = []
        self._part: Part = "content"
        self._text = _body_text()
        self._calls = 0  # tool calls started so far; the current one is `_calls - 1`
        self.called = False

    def feed(self, token_ids: Iterable[int]) -> HarmonyDelta:
        out = HarmonyDelta()
        t = self._tokens
        for token in token_ids:
            if self._state == "done":
                break
            if token in (t.return_, t.call):
                self._state = "done"
            elif token == t.end:
                self._state = "between"
            elif token == t.start:
                self._open_header()
            elif self._state == "between":
                # A message must open with <|start|>; a model that leaves it out still gets its header read.
                self._open_header()
                self._header.append(token)
            elif self._state == "header":
                if token == t.message:
                    self._open_body(out)
                else:
                    self._header.append(token)
            else:
                piece = self._text.step(t.backend, token)
                if piece:
                    self._add(out, piece)
        return out

    def _open_header(self) -> None:
        self._state, self._header = "header", []

    def _open_body(self, out: HarmonyDelta) -> None:
        header = self._tokens.backend.decode(self._header, skip_special_tokens=False)
        self._part, name = read_header(header)
        self._state = "body"
        self._text = _body_text()
        if self._part == "call":
            self.called = True
            out.calls.append(CallDelta(self._calls, "", self._new_call_id(), name))
            self._calls += 1

    def _add(self, out: HarmonyDelta, piece: str) -> None:
        if self._part == "reasoning":
            out.reasoning += piece
        elif self._part == "content":
            out.content += piece
        else:
            index = self._calls - 1
            if not out.calls or out.calls[-1].index != index:
                out.calls.append(CallDelta(index))
            out.calls[-1].arguments += piece


def _body_text() -> DecodeStream:
    # Special tokens in a body (a stray marker, an end-of-text id the model's eos list stops on) are not text.
    return DecodeStream(skip_special_tokens=True)


@dataclass
class HarmonyReply:
    """A whole reply, read at once (a non-streamed response)."""

    reasoning: str | None
    content: str | None
    calls: list[CallDelta]  # one entry per call, its arguments whole
    called: bool


def read_reply(tokens: HarmonyTokens, token_ids: list[int], new_call_id: Callable[[], str]) -> HarmonyReply:
    """The reply read whole; the same stream as streaming reads it, so the two always agree."""
    stream = HarmonyStream(tokens, new_call_id)
    delta = stream.feed(token_ids)
    calls: list[CallDelta] = []
    for piece in delta.calls:
        if piece.call_id is not None:
            calls.append(CallDelta(piece.index, piece.arguments, piece.call_id, piece.name))
        else:
            calls[-1].arguments += piece.arguments
    return HarmonyReply(delta.reasoning or None, delta.content or None, calls, stream.called)
