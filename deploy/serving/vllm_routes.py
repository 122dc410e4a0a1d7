"""vLLM's routes beyond OpenAI's API, with vLLM's request and response shapes: `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` (lm-eval's remote tokenizer), `GET /version`, `GET /ping`, and
`GET /v1/models/{id}` (the OpenAI SDK's `models.retrieve`).

They answer from the replica's own tokenizer and chat template (deploy/generation/tokenization.py), the
ones its generation routes use. The tokenizer routes need the API key when one is configured
(guards/auth.py); `/version` and `/ping` stay open, as `/health` does.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tandem.deploy.config.version import tandem_version
from tandem.deploy.generation.tokenization import Rejected
from tandem.deploy.protocol.errors import OpenAIError, from_validation_errors, invalid_request
from tandem.deploy.protocol.tokenize_requests import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tandem.deploy.serving.openai_service import OpenAIService

_TOKENIZE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        TokenizeCompletionRequest.model_json_schema(),
                        TokenizeChatRequest.model_json_schema(),
                    ]
                }
            }
        },
    }
}


def add_vllm_routes(app: FastAPI, service: OpenAIService) -> None:
    @app.post("/tokenize", openapi_extra=_TOKENIZE_BODY)
    async def tokenize(request: Request) -> dict[str, Any]:
        """A prompt's (or a chat's, rendered with the server's template) token ids: `tokens`, `count`,
        `max_model_len`, and with `return_token_strs` each token's text."""
        body = await _json_body(request)
        parsed: TokenizeCompletionRequest | TokenizeChatRequest
        if isinstance(body, dict) and "messages" in body:
            parsed = _parse(TokenizeChatRequest, body)
        else:
            parsed = _parse(TokenizeCompletionRequest, body)
        service.check_model(parsed.model)
        generation = service.generation
        tokenization = generation.tokenization
        try:
            if isinstance(parsed, TokenizeChatRequest):
                chars = sum(len(m.content) for m in parsed.messages if isinstance(m.content, str))
                tools = [t.model_dump(exclude_none=True) for t in parsed.tools or []]
                ids = await generation.off_loop(
                    chars,
                    tokenization.render_chat,
                    [m.to_template_dict() for m in parsed.messages],
                    tools=tools or None,
                    template_kwargs=parsed.chat_template_kwargs,
                    add_generation_prompt=parsed.add_generation_prompt,
                    continue_final_message=parsed.continue_final_message,
                    add_special_tokens=parsed.add_special_tokens,
                )
            else:
                ids = await generation.off_loop(
                    len(parsed.prompt),
                    tokenization.encode,
                    parsed.prompt,
                    "prompt",
                    add_special_tokens=parsed.add_special_tokens,
                )
        except Rejected as rejected:
            raise _error(rejected) from None
        strs = tokenization.token_strs(ids) if parsed.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": generation.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        """The text of `tokens`: `{"prompt": text}`."""
        service.check_model(request.model)
        generation = service.generation
        try:
            text = await generation.off_loop(
                len(request.tokens) * 4, generation.tokenization.decode, request.tokens
            )
        except Rejected as rejected:
            raise _error(rejected) from None
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's class, special tokens and chat template (lm-eval detects remote tokenizing
        from this route and `/tokenize`)."""
        generation = service.generation
        return generation.tokenization.info(generation.max_model_len)

    @app.get("/v1/models/{model_id:path}", responses={404: {"description": "Not served here."}})
    async def model(model_id: str) -> dict[str, Any]:
        """One model card: the base model's, or an adapter's (`parent`: the base)."""
        return service.model(model_id)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem_version()}

    @app.api_route("/ping", methods=["GET", "POST"], responses=HEALTH_RESPONSES)
    async def ping() -> Response:
        """SageMaker's liveness route, as vLLM serves it: `/health`'s answer."""
        return await health_response(service)


HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Every rank is up."},
    503: {"description": "A replica or rank is down, or loading."},
}


async def health_response(service: OpenAIService) -> Response:
    """200 when every replica and rank is healthy; 503 with a short reason code otherwise (the details
    are in the replica's log, not for anonymous callers)."""
    reason = await service.health()
    if reason is not None:
        error = OpenAIError(503, f"unhealthy: {reason}", type="server_error", code="unhealthy")
        return JSONResponse(error.body(), status_code=503)
    return JSONResponse({"status": "ok"})


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}", param=None, code="invalid_json") from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _error(rejected: Rejected) -> OpenAIError:
    event = rejected.event
    return invalid_request(event.message, param=event.param, code=event.code)
