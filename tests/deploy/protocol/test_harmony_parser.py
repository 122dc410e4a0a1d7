"""Reading harmony replies on token ids: channels, tool calls, truncation, and streams split anywhere."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
from transformers import PreTrainedTokenizerFast

from tandem.deploy.protocol.harmony.parser import HarmonyDelta, HarmonyStream, read_header, read_reply
from tandem.deploy.protocol.harmony.tokens import HarmonyTokens
from tandem.replicas.detokenizer import IncrementalDetokenizer, TokenDecoder

from ..harmony_tokenizer import encode, harmony_tokenizer

ANALYSIS = "<|channel|>analysis<|message|>The user wants Paris: café, 20°C ☕.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20°C in Paris — sunny.<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "c"}<|call|>'
)


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture() -> PreTrainedTokenizerFast:
    return harmony_tokenizer()


@pytest.fixture(scope="module", name="tokens")
def tokens_fixture(tokenizer: PreTrainedTokenizerFast) -> HarmonyTokens:
    return HarmonyTokens.of(tokenizer)


def call_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(tokens: HarmonyTokens, chunks: list[list[int]]) -> tuple[list[HarmonyDelta], HarmonyStream]:
    stream = HarmonyStream(tokens, call_ids())
    return [stream.feed(chunk) for chunk in chunks], stream


def joined(deltas: list[HarmonyDelta]) -> tuple[str, str, dict[int, tuple[str | None, str]]]:
    """Reasoning, content, and per call (name, arguments), as a client adds the deltas up."""
    calls: dict[int, tuple[str | None, str]] = {}
    for delta in deltas:
        for call in delta.calls:
            name, arguments = calls.get(call.index, (None, ""))
            calls[call.index] = (call.name or name, arguments + call.arguments)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls


def test_analysis_then_final_is_reasoning_then_content(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    reply = read_reply(tokens, encode(tokenizer, ANALYSIS + FINAL), call_ids())
    assert reply.reasoning == "The user wants Paris: café, 20°C ☕."
    assert reply.content == "It is 20°C in Paris — sunny."
    assert reply.calls == [] and not reply.called


def test_a_function_addressed_commentary_message_is_a_tool_call(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    reply = read_reply(tokens, encode(tokenizer, ANALYSIS + CALL), call_ids())
    assert reply.content is None and reply.called
    (call,) = reply.calls
    assert (call.index, call.name, call.call_id) == (0, "get_weather", "call_0")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize(
    "header, expected",
    [
        ("<|channel|>analysis", ("reasoning", None)),
        ("assistant<|channel|>final", ("content", None)),
        ("assistant<|channel|>commentary", ("content", None)),  # a preamble shown to the user
        ("assistant to=functions.lookup<|channel|>commentary json", ("call", "lookup")),
        ("assistant<|channel|>commentary to=functions.a_b <|constrain|>json", ("call", "a_b")),
        ("assistant<|channel|>analysis to=browser.search", ("reasoning", None)),  # a built-in tool
        ("assistant", ("content", None)),
    ],
)
def test_headers(header: str, expected: tuple[str, str | None]) -> None:
    assert read_header(header) == expected


def test_every_split_into_three_streams_the_same_reply(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    # Cuts inside markers' neighbourhoods, inside multi-byte characters (é, °, ☕, — are several byte
    # tokens each) and between a header and its body: the deltas always add up to the whole reply.
    ids = encode(
        tokenizer, ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    )
    whole = read_reply(tokens, ids, call_ids())
    for i, j in itertools.combinations(range(len(ids) + 1), 2):
        deltas, stream = streamed(tokens, [ids[:i], ids[i:j], ids[j:]])
        reasoning, content, calls = joined(deltas)
        assert reasoning == whole.reasoning and content == whole.content == "Checking."
        assert calls == {0: ("get_weather", whole.calls[0].arguments)}
        assert stream.called
        assert "\ufffd" not in reasoning + content  # no character was cut in two


def test_one_token_at_a_time_names_the_call_first(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    ids = encode(tokenizer, CALL)
    deltas, _ = streamed(tokens, [[t] for t in ids])
    calls = [c for d in deltas for c in d.calls]
    first = calls[0]
    # The call opens at its <|message|>, before any argument: id and name come first, the arguments after.
    assert (first.name, first.call_id, first.arguments) == ("get_weather", "call_0", "")
    assert all(c.call_id is None and c.name is None for c in calls[1:])
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris", "unit": "c"}


def test_a_reply_cut_off_in_analysis_is_all_reasoning(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    ids = encode(tokenizer, ANALYSIS)[:-6]  # max_tokens hit mid-thought: no <|end|>
    reply = read_reply(tokens, ids, call_ids())
    assert reply.content is None and reply.calls == [] and not reply.called
    assert reply.reasoning is not None and "The user wants Paris".startswith(reply.reasoning[:20])
    # Cut inside the next message's header: nothing of it shows.
    ids = encode(tokenizer, ANALYSIS + "<|start|>assistant<|channel|>fin")
    reply = read_reply(tokens, ids, call_ids())
    assert reply.reasoning == "The user wants Paris: café, 20°C ☕." and reply.content is None


def test_tokens_after_the_end_of_the_reply_are_ignored(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    ids = encode(tokenizer, FINAL + "<|start|>assistant<|channel|>final<|message|>more")
    assert read_reply(tokens, ids, call_ids()).content == "It is 20°C in Paris — sunny."


def test_special_tokens_inside_a_body_are_not_text(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    ids = encode(tokenizer, "<|channel|>final<|message|>a<|constrain|>b<|endoftext|>c<|return|>")
    assert read_reply(tokens, ids, call_ids()).content == "abc"


def test_a_tokenizer_without_the_harmony_tokens_is_refused() -> None:
    from tandem.engine.tiny import load_tiny_tokenizer

    with pytest.raises(ValueError, match=r"lacks the harmony special tokens \['<\|start\|>'"):
        HarmonyTokens.of(load_tiny_tokenizer())


def replica_stop(tokenizer: PreTrainedTokenizerFast, ids: list[int], stops: list[str]) -> list[int]:
    """The ids the replica generates before its detokenizer finds a stop string (the last one included)."""
    detok = IncrementalDetokenizer(TokenDecoder(tokenizer), [], stops)
    for n, token in enumerate(ids, 1):
        detok.add(token)
        if detok.stopped:
            return ids[:n]
    raise AssertionError(f"no stop string of {stops} in the reply")


@pytest.mark.parametrize(
    "stops, reasoning, content",
    [
        (["Paris —"], "The user wants Paris: café, 20°C ☕.", "It is 20°C in "),
        (["°C ☕", "zzz"], "The user wants Paris: café, 20", None),  # cut inside a multi-byte character
        # Matched as the replica matches: on the text with the markers left out, headers' words in.
        (["☕.assistantfinalIt"], "The user wants Paris: café, 20°C ", None),
    ],
)
def test_stop_strings_cut_the_fields_where_they_begin_however_the_reply_is_split(
    tokenizer: PreTrainedTokenizerFast,
    tokens: HarmonyTokens,
    stops: list[str],
    reasoning: str,
    content: str | None,
) -> None:
    ids = replica_stop(tokenizer, encode(tokenizer, ANALYSIS + FINAL), stops)
    whole = read_reply(tokens, ids, call_ids(), stops)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for i in range(len(ids) + 1):
        stream = HarmonyStream(tokens, call_ids(), stops)
        deltas = [stream.feed(ids[:i]), stream.feed(ids[i:], last=True)]
        assert joined(deltas)[:2] == (reasoning, content or "")
        assert "\ufffd" not in reasoning + (content or "")


def test_text_that_may_begin_a_stop_string_is_held_until_the_reply_ends(
    tokenizer: PreTrainedTokenizerFast, tokens: HarmonyTokens
) -> None:
    ids = encode(tokenizer, "<|channel|>final<|message|>Paris is sunny")
    stream = HarmonyStream(tokens, call_ids(), ["sunny and warm"])
    assert stream.feed(ids).content == "Paris is "  # "sunny" may begin the stop string
    assert stream.feed([], last=True).content == "sunny"  # cut off by max_tokens: released
