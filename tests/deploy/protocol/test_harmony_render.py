"""Rendering chats as harmony: the messages as gpt-oss's template takes them, tandem's fallback template's
output, and what `HarmonyChat` does to a chat job (effort, stops, refusals)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from tandem.deploy.config.args import AppArgs
from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.protocol.harmony.chat import HarmonyChat
from tandem.deploy.protocol.harmony.messages import harmony_messages
from tandem.deploy.protocol.harmony.template import HARMONY_TEMPLATE
from tandem.deploy.protocol.job_builder import chat_job
from tandem.deploy.protocol.jobs import GenerateJob
from tandem.deploy.protocol.requests import ChatCompletionRequest
from tandem.engine.tiny import load_tiny_tokenizer

from ..harmony_tokenizer import harmony_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city."},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": "array", "items": {"type": "integer"}},
                "near": {
                    "type": "object",
                    "properties": {"lat": {"type": ["number", "null"]}},
                    "required": ["lat"],
                },
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time."}}


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture() -> PreTrainedTokenizerFast:
    return harmony_tokenizer()


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(
        harmony_messages(messages), tokenize=False, add_generation_prompt=True, **kwargs
    )
    return str(text)


def system(effort: str, tools: bool) -> str:
    today = datetime.date.today().isoformat()
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
        f"{calls}<|end|>"
    )


def test_system_developer_and_tools(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    text = render(tokenizer, messages, tools=[WEATHER, CLOCK], reasoning_effort="high")
    assert text == (
        system("high", tools=True) + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n"
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Gets the weather.\ntype get_weather = (_: {\n// The city.\ncity: string,\n"
        'unit?: "c" | "f", // default: "c"\ndays?: number[],\nnear?: { lat: number | null },\n'
        "}) => any;\n\n// The time.\ntype now = () => any;\n\n} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
    )


def test_no_instructions_no_tools_no_developer_message(tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == system("medium", tools=False) + "<|start|>user<|message|>Hi<|end|><|start|>assistant"


def test_history_of_calls_results_and_answers(tokenizer: PreTrainedTokenizerFast) -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},  # answered out of order
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    start = system("low", tools=False) + "<|start|>user<|message|>Weather?<|end|>"
    # No answer yet: the reasoning that led to the calls is shown before them, each call then its result.
    pending = (
        "<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>functions.now to=assistant<|channel|>commentary<|message|>noon<|end|>"
    )
    assert render(tokenizer, messages, reasoning_effort="low") == start + pending + "<|start|>assistant"
    # Once answered, earlier reasoning is dropped, as gpt-oss was trained.
    answered = [
        *messages,
        {"role": "assistant", "content": "Sunny at noon.", "reasoning_content": "Easy."},
        {"role": "user", "content": "Thanks"},
    ]
    text = render(tokenizer, answered, reasoning_effort="low")
    assert text == (
        start
        + pending.split("<|end|>", 1)[1]
        + "<|start|>assistant<|channel|>final<|message|>Sunny at noon.<|end|>"
        + "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )


def test_messages_as_the_template_takes_them() -> None:
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}
    out = harmony_messages(
        [
            {
                "role": "assistant",
                "content": "Let me look.",
                "reasoning_content": "why",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": "a", "content": None},
            {"role": "assistant", "content": "done"},
        ]
    )
    # gpt-oss's template takes the analysis from one field only, and checks `"thinking" in message`.
    assert out == [
        {"role": "assistant", "content": "", "thinking": "why", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a", "content": ""},
        {"role": "assistant", "content": "done"},
    ]


def test_the_template_is_the_servers_then_the_models_then_tandems() -> None:
    assert HarmonyChat.chat_template("{{ x }}", harmony_tokenizer()) == "{{ x }}"
    assert HarmonyChat.chat_template(None, harmony_tokenizer()) is None  # the tokenizer's own
    assert HarmonyChat.chat_template(None, harmony_tokenizer(chat_template=None)) == HARMONY_TEMPLATE


def test_chosen_by_model_type() -> None:
    assert HarmonyChat.for_model("qwen3", harmony_tokenizer()) is None
    assert HarmonyChat.for_model("gpt_oss", harmony_tokenizer()) is not None
    with pytest.raises(ValueError, match="harmony special tokens"):
        HarmonyChat.for_model("gpt_oss", load_tiny_tokenizer())


def test_reasoning_parser_openai_gptoss_means_harmony_and_another_is_refused_for_gpt_oss() -> None:
    assert HarmonyChat.for_model("gpt_oss", harmony_tokenizer(), "openai_gptoss") is not None
    # vLLM's name serves any model whose tokenizer has the harmony tokens in harmony...
    assert HarmonyChat.for_model("qwen3", harmony_tokenizer(), "openai_gptoss") is not None
    assert HarmonyChat.for_model("qwen3", harmony_tokenizer(), "qwen3") is None
    # ...and names the flag when it has not.
    with pytest.raises(ValueError, match=r"^--reasoning-parser openai_gptoss: .*harmony special tokens"):
        HarmonyChat.for_model("qwen3", load_tiny_tokenizer(), "openai_gptoss")
    for parser in ("qwen3", "deepseek_r1"):
        with pytest.raises(
            ValueError, match=rf"^--reasoning-parser \(reasoning_parser\) '{parser}' does not"
        ):
            HarmonyChat.for_model("gpt_oss", harmony_tokenizer(), parser)


def test_the_serve_flag_takes_openai_gptoss() -> None:
    from tandem.deploy.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--reasoning-parser", "openai_gptoss"])
    assert args.reasoning_parser == "openai_gptoss"
    assert AppArgs.model_validate({"reasoning_parser": "openai_gptoss"}).reasoning_parser == "openai_gptoss"


def job_of(body: dict[str, Any]) -> GenerateJob:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    return chat_job(request, "chatcmpl-1", 0.0)


def test_prepare_sets_effort_stops_and_tools() -> None:
    tokenizer = harmony_tokenizer()
    harmony = HarmonyChat.for_model("gpt_oss", tokenizer)
    assert harmony is not None
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    job = harmony.prepare(job_of({"stop_token_ids": [5]}))
    assert job.chat_template_kwargs == {"reasoning_effort": "medium"}
    assert job.sampling.stop_token_ids == [5, *stops]
    assert harmony.prepare(job_of({"ignore_eos": True})).sampling.stop_token_ids == []
    job = harmony.prepare(
        job_of({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}})
    )
    assert job.chat_template_kwargs == {"reasoning_effort": "low"}  # the request field wins
    assert harmony.prepare(job_of({"tools": [WEATHER]})).tools == [WEATHER]
    assert harmony.prepare(job_of({"tools": [WEATHER], "tool_choice": "none"})).tools is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"chat_template_kwargs": {"reasoning_effort": "max"}}, "chat_template_kwargs.reasoning_effort"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_prepare_refuses_what_harmony_cannot_serve(body: dict[str, Any], param: str) -> None:
    harmony = HarmonyChat.for_model("gpt_oss", harmony_tokenizer())
    assert harmony is not None
    with pytest.raises(OpenAIError) as caught:
        harmony.prepare(job_of(body))
    assert caught.value.status == 400 and caught.value.param == param
