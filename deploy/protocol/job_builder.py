"""OpenAI request models -> `GenerateJob`s, with SamplingParams validated at the ingress."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.deploy.protocol.constraints import check_supported, logit_bias, structured_outputs
from tandem.deploy.protocol.errors import invalid_request
from tandem.deploy.protocol.jobs import GenerateJob
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.deploy.protocol.tool_calls import ToolMode, tool_mode
from tandem.scheduler.sampling_params import SamplingParams, StructuredOutputs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams; `max_tokens=None` (rest of the context) is resolved server-side."""
    check_supported(req, req.n)
    params = SamplingParams(
        # A placeholder for "the rest of the context" that min_tokens' check accepts until it is resolved.
        max_tokens=max_tokens if max_tokens is not None else max(1, req.min_tokens),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=-1 if req.top_k == 0 else req.top_k,  # OpenAI-style clients send 0 for "off"
        min_p=req.min_p,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_tokens=req.min_tokens,
        logit_bias=logit_bias(req),
        structured_outputs=structured,
        prompt_logprobs=prompt_logprobs,
        speculative=req.speculative,
    )
    try:
        params.validate()  # pydantic already checked the ranges; this keeps both in step
    except ValueError as exc:
        message = str(exc)
        raise invalid_request(message, param=message.split()[0]) from None
    return params


def completion_job(req: CompletionRequest, request_id: str, arrival_time: float) -> GenerateJob:
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    echo_only = req.echo and max_tokens == 0
    if max_tokens == 0 and not echo_only:
        raise invalid_request("max_tokens: must be >= 1 (0 only with echo=true)", param="max_tokens")
    if echo_only:
        # As vLLM does: one token is generated and dropped, so the prompt is scored in the same pass.
        max_tokens = 1
    structured, field = structured_outputs(req)
    params = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        structured=structured,
        # echo with logprobs: the prompt's tokens come back scored too, with as many alternatives.
        prompt_logprobs=req.logprobs if req.echo else None,
    )
    return GenerateJob(
        echo=req.echo,
        echo_only=echo_only,
        structured_param=field,
        request_id=request_id,
        sampling=params,
        n=req.n,
        prompts=req.prompts(),
        max_tokens=max_tokens,
        token_strings=req.logprobs is not None,
        arrival_time=arrival_time,
    )


def chat_job(req: ChatCompletionRequest, request_id: str, arrival_time: float) -> GenerateJob:
    max_tokens = req.resolved_max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = _tool_mode(req)
    structured, field = structured_outputs(req)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if structured is not None:
            raise invalid_request(
                f"tool_choice forces a tool call, which {field} would constrain too", param=field
            )
        structured, field = forced, "tools"
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, structured=structured)
    return GenerateJob(
        structured_param=field,
        tools=tools.tools if tools is not None else None,
        tool_mode=tools,
        request_id=request_id,
        sampling=params,
        n=req.n,
        messages=[m.to_template_dict() for m in req.messages],
        chat_template_kwargs=_template_kwargs(req),
        max_tokens=max_tokens,
        token_strings=req.logprobs,
        arrival_time=arrival_time,
    )


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The client's template variables, with `reasoning_effort` (the request field wins) among them."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}


def _tool_mode(req: ChatCompletionRequest) -> ToolMode | None:
    try:
        return tool_mode(req)
    except ValueError as exc:
        raise invalid_request(str(exc), param="tool_choice") from None


def choice_sampling(job: GenerateJob, index: int, max_tokens: int) -> SamplingParams:
    """The SamplingParams of choice `index`: distinct seeds, so n seeded choices differ but repeat."""
    seed = job.sampling.seed
    if seed is not None:
        # Wrap into int64: the seed travels as a signed 64-bit integer.
        seed = ((seed + index + 2**63) % 2**64) - 2**63
    return replace(job.sampling, max_tokens=max_tokens, seed=seed)
