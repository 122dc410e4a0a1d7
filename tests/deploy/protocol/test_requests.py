"""OpenAI request validation, the 400 error shape, and request -> GenerateJob / SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tandem.deploy.protocol.errors import OpenAIError, from_validation_errors, model_not_found
from tandem.deploy.protocol.job_builder import chat_job, choice_sampling, completion_job, sampling_params
from tandem.deploy.protocol.requests import (
    INT64_MAX,
    VLLM_EXTENSIONS,
    ChatCompletionRequest,
    CompletionRequest,
)

CHAT = [{"role": "user", "content": "hi"}]
CHAT_ONLY = {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"}


def _error(
    cls: type[CompletionRequest] | type[ChatCompletionRequest], body: dict[str, Any]
) -> dict[str, Any]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    error = from_validation_errors(info.value.errors())
    assert error.status == 400
    body_out = error.body()
    assert set(body_out["error"]) == {"message", "type", "param", "code"}
    return dict(body_out["error"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "temperature": 2.01}, "temperature"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "seed": INT64_MAX + 1}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop.0"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"prompt": [1, -1]}, "prompt.1"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({}, "prompt"),
    ],
)
def test_completion_validation_names_the_field(body: dict[str, Any], param: str) -> None:
    error = _error(CompletionRequest, body)
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "messages", "missing_required_parameter"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, "invalid_value"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ],
)
def test_chat_validation(body: dict[str, Any], param: str | None, code: str) -> None:
    error = _error(ChatCompletionRequest, body)
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages.0.content")
    assert error["code"] == code


def test_json_errors_and_other_fields_are_reported() -> None:
    invalid_json = from_validation_errors(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error"}]
    )
    assert invalid_json.status == 400 and invalid_json.code == "invalid_json"
    two_fields = _error(CompletionRequest, {"prompt": "x", "temperature": -1, "top_p": 7})
    assert "also invalid" in two_fields["message"]


def test_prompts_are_normalised() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "logit_bias": {}}).prompts() == ["x"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_unknown_fields_are_a_400_naming_every_one(
    cls: type[CompletionRequest] | type[ChatCompletionRequest],
) -> None:
    base: dict[str, Any] = {"prompt": "x"} if cls is CompletionRequest else {"messages": CHAT}
    error = _error(cls, {**base, "max_token": 5, "temprature": 0, "temperature": 0.5})
    assert error["message"] == "Unrecognized request arguments supplied: max_token, temprature"
    assert (error["param"], error["code"]) == ("max_token", "unknown_parameter")
    one = _error(cls, {**base, "max_token": 5})
    assert one["message"] == "Unrecognized request argument supplied: max_token"
    # Unknown keys inside messages are what SDKs send back from earlier replies: not an error.
    if cls is ChatCompletionRequest:
        cls.model_validate({"messages": [{"role": "assistant", "content": "x", "refusal": None}]})


def test_every_listed_vllm_extension_is_accepted() -> None:
    neutral = {
        "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "stop_token_ids": [], "ignore_eos": False,
        "min_tokens": 0, "structured_outputs": None, "guided_json": None, "guided_regex": None,
        "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": "xgrammar",
        "guided_whitespace_pattern": None, "chat_template_kwargs": {}, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
        "add_generation_prompt": True, "continue_final_message": False, "prompt_logprobs": None,
        "use_beam_search": False,
    }  # fmt: skip
    assert set(neutral) == set(VLLM_EXTENSIONS)
    chat = ChatCompletionRequest.model_validate({"messages": CHAT, **neutral})
    chat_job(chat, "chatcmpl-1", 0.0)  # and none of them is refused further on
    completion_only = {k: v for k, v in neutral.items() if k not in CHAT_ONLY}
    completion_job(CompletionRequest.model_validate({"prompt": "x", **completion_only}), "cmpl-1", 0.0)
    with pytest.raises(OpenAIError) as refused:
        completion_job(CompletionRequest(prompt="x", skip_special_tokens=False), "cmpl-1", 0.0)
    assert refused.value.param == "skip_special_tokens" and refused.value.code == "unsupported_parameter"


def test_sampling_mapping() -> None:
    req = CompletionRequest(
        prompt="x", temperature=0, top_p=0.5, top_k=0, min_p=0.1, seed=3, stop="END", stop_token_ids=[7],
        ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=2,
    )  # fmt: skip
    job = completion_job(req, "cmpl-1", 0.0)
    params = job.sampling
    assert params.max_tokens == 16  # OpenAI's completions default
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0, 0.5, -1, 0.1)
    assert (params.seed, params.stop, params.stop_token_ids, params.ignore_eos) == (3, "END", [7], True)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.logprobs == 2 and job.token_strings


def test_chat_job_limits_and_logprobs() -> None:
    both = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "max_tokens": 50, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}
    )
    job = chat_job(both, "chatcmpl-1", 0.0)
    assert job.max_tokens == 5 and job.sampling.logprobs == 3 and job.token_strings
    assert job.messages == [{"role": "user", "content": "hi"}]
    default = chat_job(ChatCompletionRequest.model_validate({"messages": CHAT}), "c", 0.0)
    assert default.max_tokens is None  # the rest of the context, resolved on the server
    assert default.sampling.logprobs is None and not default.token_strings
    parts = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        }
    )
    assert chat_job(parts, "c", 0.0).messages == [{"role": "user", "content": "ab"}]


def test_choice_seeds_are_distinct_and_wrap_int64() -> None:
    job = completion_job(CompletionRequest(prompt="x", n=3, seed=INT64_MAX), "c", 0.0)
    seeds = [choice_sampling(job, i, 8).seed for i in range(3)]
    assert seeds[0] == INT64_MAX and len(set(seeds)) == 3
    assert all(-(2**63) <= s <= INT64_MAX for s in seeds if s is not None)
    unseeded = completion_job(CompletionRequest(prompt="x", n=2), "c", 0.0)
    assert choice_sampling(unseeded, 1, 8).seed is None
    assert choice_sampling(unseeded, 1, 8).max_tokens == 8


def test_sampling_params_backstop_names_the_field() -> None:
    req = CompletionRequest(prompt="x")
    req.temperature = -1.0  # pydantic does not re-validate on assignment: SamplingParams.validate must
    with pytest.raises(OpenAIError) as info:
        sampling_params(req, max_tokens=4, logprobs=None)
    assert info.value.status == 400 and info.value.param == "temperature"


def test_model_not_found_shape() -> None:
    error = model_not_found("gpt-9", "tiny")
    assert error.status == 404
    assert error.body()["error"]["code"] == "model_not_found" and error.param == "model"
    many = model_not_found("gpt-9", "tiny", [f"a{i}" for i in range(30)])
    assert "serves 'tiny', 'a0', " in many.message and "'a19' and 10 more (GET /v1/models" in many.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": True, "stream_options": {"include_usage": True, "include_usgae": True}}, "include_usgae"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "shema": {}}}}, "shema"),
        ({"structured_outputs": {"regex": "a+", "regexp": "b"}}, "regexp"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]}, "parameter"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}, "force": True},
            },
            "force",
        ),
    ],
)
def test_unknown_keys_of_nested_objects_are_a_400_naming_their_path(body: dict[str, Any], param: str) -> None:
    error = _error(ChatCompletionRequest, {"messages": CHAT, **body})
    path = {
        "include_usgae": "stream_options.include_usgae",
        "shema": "response_format.json_schema.shema",
        "regexp": "structured_outputs.regexp",
        "parameter": "tools.0.function.parameter",
        "force": "tool_choice.force",
    }[param]
    assert (error["code"], error["param"]) == ("unknown_parameter", path)
    assert error["message"] == f"Unrecognized request argument supplied: {path}"


def test_messages_keep_ignoring_the_keys_sdks_send_back() -> None:
    echoed = {"role": "assistant", "content": "x", "refusal": None, "annotations": []}
    request = ChatCompletionRequest.model_validate({"messages": [*CHAT, echoed, *CHAT]})
    assert len(request.messages) == 3


def test_template_kwargs_are_plain_json_values() -> None:
    ok = {"enable_thinking": False, "n": [1, 2.5, "x", None, {"k": True}]}
    assert ChatCompletionRequest(messages=CHAT, chat_template_kwargs=ok).chat_template_kwargs == ok

    class Sneaky(str):
        def __html__(self) -> str:
            return "<script>"

    # A handle call passes Python objects as they are: only JSON data may reach the template.
    for bad in ({"x": object()}, {"x": Sneaky("a")}, {"x": {1: "int key"}}, {"x": (1, 2)}):
        error = _error(ChatCompletionRequest, {"messages": CHAT, "chat_template_kwargs": bad})
        assert error["param"] == "chat_template_kwargs" and "plain JSON" in error["message"]
