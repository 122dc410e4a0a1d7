"""Reasoning parsers (`--reasoning-parser`, as vLLM's): a reasoning model's `<think>...</think>` is split out
of the reply into `reasoning_content`, whole and in streamed deltas; tool calls and the reply's content are
read from what follows.

- `deepseek_r1`: the chat template opens the `<think>` block in the prompt, so the reply starts inside it
  (a `<think>` the model writes again is dropped) and reasoning lasts until `</think>`; a reply cut off
  before `</think>` is all reasoning.
- `qwen3`: a reply that opens with `<think>` reasons until `</think>`; one that does not (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty block in the prompt)
  is all content.

Streaming and whole replies split alike: the streamed deltas of each part add up to the whole reply's.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the template opened the block in the prompt (DeepSeek-R1)
    start: str = THINK_START
    end: str = THINK_END


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole reply; None for a part that is not there."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if stream.reasoned else None), (content or None)


class ReasoningStream:
    """One choice's reply, fed delta by delta: each call says what is new reasoning and what is new content.

    Text that might be the start of a tag (`</thi` at the end of a delta) is held until the next delta
    tells, or the reply ends (`finish`)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        # "open": undecided whether the reply opens with the start tag; "inside"; "after"; "content".
        self.state = "inside" if fmt.starts_inside else "open"
        self.reasoned = fmt.starts_inside  # whether the reply has a reasoning part at all
        self._held = ""
        self._seen_start = False

    def feed(self, text: str) -> tuple[str, str]:
        pending = self._held + text
        self._held = ""
        reasoning, content = "", ""
        while pending:
            if self.state == "open":
                stripped = pending.lstrip()
                if self.fmt.start.startswith(stripped):  # "", "<", "<thi": not known yet
                    self._held = pending
                    return reasoning, content
                if stripped.startswith(self.fmt.start):
                    pending = stripped[len(self.fmt.start) :]
                    self.state, self.reasoned, self._seen_start = "inside", True, True
                    continue
                self.state = "content"
            if self.state == "inside":
                if not self._seen_start:  # DeepSeek-R1 may write the tag the prompt already opened
                    stripped = pending.lstrip()
                    if self.fmt.start.startswith(stripped):  # "", "<thi": not known yet
                        self._held = pending
                        return reasoning, content
                    if stripped.startswith(self.fmt.start):
                        pending = stripped[len(self.fmt.start) :]
                    self._seen_start = True
                    continue
                end = pending.find(self.fmt.end)
                if end >= 0:
                    reasoning += pending[:end]
                    pending = pending[end + len(self.fmt.end) :]
                    self.state = "after"
                    continue
                keep = _partial_suffix(pending, self.fmt.end)
                reasoning += pending[: len(pending) - keep]
                self._held = pending[len(pending) - keep :]
                return reasoning, content
            content += pending  # "after" and "content"
            pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended: a tag that never completed is plain text."""
        held, self._held = self._held, ""
        if self.state == "inside":
            return held, ""
        return "", held

    @property
    def in_reasoning(self) -> bool:
        return self.state in ("open", "inside")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
