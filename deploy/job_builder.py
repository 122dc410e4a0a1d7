"""OpenAI request models -> `GenerateJob`s, with SamplingParams validated at the ingress."""

from __future__ import annotations

from dataclasses import replace

from tandem.deploy.errors import invalid_request
from tandem.deploy.jobs import GenerateJob
from tandem.deploy.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.scheduler.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams; `max_tokens=None` (rest of the context) is resolved server-side."""
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 1,
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
    )
    try:
        params.validate()  # pydantic already checked the ranges; this keeps both in step
    except ValueError as exc:
        message = str(exc)
        raise invalid_request(message, param=message.split()[0]) from None
    return params


def completion_job(req: CompletionRequest, request_id: str, arrival_time: float) -> GenerateJob:
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
    return GenerateJob(
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
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    return GenerateJob(
        request_id=request_id,
        sampling=params,
        n=req.n,
        messages=[m.to_template_dict() for m in req.messages],
        chat_template_kwargs=req.chat_template_kwargs,
        max_tokens=max_tokens,
        token_strings=req.logprobs,
        arrival_time=arrival_time,
    )


def choice_sampling(job: GenerateJob, index: int, max_tokens: int) -> SamplingParams:
    """The SamplingParams of choice `index`: distinct seeds, so n seeded choices differ but repeat."""
    seed = job.sampling.seed
    if seed is not None:
        # Wrap into int64: the seed travels as a signed 64-bit integer.
        seed = ((seed + index + 2**63) % 2**64) - 2**63
    return replace(job.sampling, max_tokens=max_tokens, seed=seed)
