"""Reading a harmony reply: a state machine over the harmony special-token ids, with the text between them
decoded incrementally.

A reply is a run of messages. The prompt ends with `<|start|>assistant`, so the first message's header
is already open; every later one starts with `<|start|>`. A header (`assistant<|channel|>analysis`,
`<|channel|>commentary to=functions.get_weather <|constrain|>json`) ends at `<|message|>`, its body at
`<|end|>`, or at `<|return|>` / `<|call|>`, which end the reply. What each message becomes:

- channel `analysis`, or a recipient other than `functions.*` (a built-in tool): `reasoning_content`;
- a recipient `functions.NAME`: a tool call of NAME whose arguments are the body;
- channel `final`, a `commentary` preamble without recipient, anything else: `content`.

Token boundaries never matter: a header is read whole at its `<|message|>`, and text goes through a
`DecodeStream`, which holds the bytes of a character split over tokens until it is whole. Stop strings
(`stop`) cut the fields where the stop string begins (`StopCut`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenizers.decoders import DecodeStream

from tandem.deploy.protocol.harmony.tokens import HarmonyTokens
from tandem.scheduler.sampling_params import first_stop, partial_stop_len

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


Target = tuple[Part, int] | None  # where text goes: a part (and the call it adds to), or nowhere (a header)


class StopCut:
    """The reply's text cut at the first stop string (`stop`), matched as the replica's detokenizer matches
    it, which is what ended the generation: on the text with the special tokens left out, headers' words
    (`analysis`, `assistant`, `final`) in. So the fields end where the stop string begins, not at the end
    of the token that completed it. Text that may begin a stop string is held until the next piece tells
    or the reply ends."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)
        self._held: list[tuple[Target, str]] = []
        self.cut = False  # a stop string was found: nothing after it is read

    def add(self, target: Target, piece: str) -> list[tuple[Target, str]]:
        """What can be released now that `piece` (of `target`) came."""
        if not self._stops:
            return [(target, piece)]
        self._held.append((target, piece))
        pending = "".join(text for _, text in self._held)
        at = first_stop(pending, self._stops)
        if at is not None:
            self.cut = True
            released = self._release(at)
            self._held = []
            return released
        return self._release(len(pending) - partial_stop_len(pending, self._stops))

    def flush(self) -> list[tuple[Target, str]]:
        return self._release(sum(len(text) for _, text in self._held))

    def _release(self, chars: int) -> list[tuple[Target, str]]:
        out: list[tuple[Target, str]] = []
        while chars > 0 and self._held:
            target, text = self._held[0]
            if len(text) > chars:
                out.append((target, text[:chars]))
                self._held[0] = (target, text[chars:])
                break
            out.append((target, text))
            self._held.pop(0)
            chars -= len(text)
        return out


class HarmonyStream:
    """One choice's reply, fed token ids as they come; each `feed` returns what they added.

    `called` says whether the reply addressed a function (and no stop string cut it), which makes a
    `stop` a `tool_calls` finish. `stops`: the request's stop strings (see `StopCut`).
    """

    def __init__(
        self, tokens: HarmonyTokens, new_call_id: Callable[[], str], stops: Sequence[str] = ()
    ) -> None:
        self._tokens = tokens
        self._new_call_id = new_call_id
        self._state: Literal["header", "body", "between", "done"] = "header"
        self._header: list[int] = []
        self._part: Part = "content"
        # One stream over the whole reply, as the replica's detokenizer decodes it (special tokens are not
        # text), so that stop strings are matched on the same text; it holds the bytes of a character
        # split over tokens until the character is whole.
        self._text = DecodeStream(skip_special_tokens=True)
        self._cut = StopCut(stops)
        self._known = tokens.backend.get_vocab_size(with_added_tokens=True)
        self._calls = 0  # tool calls started so far; the current one is `_calls - 1`
        self._called = False

    @property
    def called(self) -> bool:
        return self._called and not self._cut.cut

    def feed(self, token_ids: Iterable[int], *, last: bool = False) -> HarmonyDelta:
        """What `token_ids` added; `last`: the reply ends with them (held text is released)."""
        out = HarmonyDelta()
        t = self._tokens
        for token in token_ids:
            if self._state == "done":
                break
            if not 0 <= token < self._known:
                continue  # an id past the tokenizer (a padded LM head) is no text, as for the detokenizer
            piece = self._text.step(t.backend, token)
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
            if piece:
                target: Target = (self._part, self._calls - 1) if self._state == "body" else None
                self._add(out, self._cut.add(target, piece))
                if self._cut.cut:
                    self._state = "done"
        if last or self._state == "done":
            self._add(out, self._cut.flush())
        out.calls.sort(key=lambda call: call.index)  # a held call's arguments before the next call's header
        return out

    def _open_header(self) -> None:
        self._state, self._header = "header", []

    def _open_body(self, out: HarmonyDelta) -> None:
        header = self._tokens.backend.decode(self._header, skip_special_tokens=False)
        self._part, name = read_header(header)
        self._state = "body"
        if self._part == "call":
            self._called = True
            out.calls.append(CallDelta(self._calls, "", self._new_call_id(), name))
            self._calls += 1

    @staticmethod
    def _add(out: HarmonyDelta, pieces: list[tuple[Target, str]]) -> None:
        for target, piece in pieces:
            if target is None:
                continue  # a header's words: not part of any field
            part, index = target
            if part == "reasoning":
                out.reasoning += piece
            elif part == "content":
                out.content += piece
            else:
                call = next((c for c in reversed(out.calls) if c.index == index), None)
                if call is None:
                    call = CallDelta(index)
                    out.calls.append(call)
                call.arguments += piece


@dataclass
class HarmonyReply:
    """A whole reply, read at once (a non-streamed response)."""

    reasoning: str | None
    content: str | None
    calls: list[CallDelta]  # one entry per call, its arguments whole
    called: bool


def read_reply(
    tokens: HarmonyTokens,
    token_ids: list[int],
    new_call_id: Callable[[], str],
    stops: Sequence[str] = (),
) -> HarmonyReply:
    """The reply read whole; the same stream as streaming reads it, so the two always agree."""
    stream = HarmonyStream(tokens, new_call_id, stops)
    delta = stream.feed(token_ids, last=True)
    calls: list[CallDelta] = []
    for piece in delta.calls:  # by index, each call's header delta first
        if piece.call_id is not None:
            calls.append(CallDelta(piece.index, piece.arguments, piece.call_id, piece.name))
        else:
            calls[-1].arguments += piece.arguments
    return HarmonyReply(delta.reasoning or None, delta.content or None, calls, stream.called)
