"""The FastAPI app of the LLMServer: OpenAI routes over an `OpenAIService`, and OpenAI-shaped errors.

Built per replica (no module-level app), so each replica's routes close over its own service.
FastAPI answers a body that fails validation, or is not JSON at all, with 422; OpenAI clients expect 400
with an `{"error": ...}` body, so the handlers below replace FastAPI's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from tandem.deploy.guards.auth import ApiKeyMiddleware, ApiKeys
from tandem.deploy.guards.body_limit import BodyLimitMiddleware
from tandem.deploy.guards.shutdown import DrainGate, GateState
from tandem.deploy.observability.exposition import CONTENT_TYPE, node_tandem_metrics
from tandem.deploy.protocol.errors import (
    OpenAIError,
    from_validation_errors,
    internal_error,
    not_json,
    unavailable,
)
from tandem.deploy.protocol.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest
from tandem.deploy.serving.openai_service import ChunkBatches, OpenAIService
from tandem.deploy.serving.vllm_routes import HEALTH_RESPONSES, add_vllm_routes, health_response

logger = logging.getLogger(__name__)

SSE_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid parameters, or a prompt plus max_tokens over the context length."},
    401: {"description": "An API key is configured and the request has no valid `Authorization: Bearer`."},
    404: {"description": "Unknown model (the message lists the served model and its adapters)."},
    413: {"description": "The body is larger than max_request_body_bytes."},
    503: {"description": "Overloaded (past max_queued_requests) or no healthy replica."},
}
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response, or with `stream: true` server-sent events ending in `data: [DONE]`.",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **_ERROR_RESPONSES,
}

_encoder = msgspec.json.Encoder()


def error_response(error: OpenAIError) -> JSONResponse:
    headers = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def sse_events(batches: ChunkBatches) -> AsyncGenerator[bytes, None]:
    """`data: <json>` per chunk, each batch in one write as soon as it exists, then `data: [DONE]`."""
    async with aclosing(batches):
        async for batch in batches:
            if batch:
                yield b"".join(b"data: " + _encoder.encode(chunk) + b"\n\n" for chunk in batch)
    yield b"data: [DONE]\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    When the client goes away, Starlette (or Serve cancelling the request) leaves the iterator
    suspended, and an unclosed generator would keep the request generating on the ranks until it
    finished. Closing it runs the `finally`s down the chain, which abort the request on the ranks.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            pass  # Serve's way of saying the client disconnected: nobody is left to answer
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()


def _to_http(result: dict[str, Any] | ChunkBatches) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return ClosingStreamingResponse(sse_events(result), media_type="text/event-stream", headers=SSE_HEADERS)


def build_http_app(
    service: OpenAIService,
    api_keys: ApiKeys | None = None,
    max_body_bytes: int | None = None,
    gate: GateState | None = None,
    metrics: Callable[[], Awaitable[str]] = node_tandem_metrics,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    app = FastAPI(
        title="tandem",
        summary="OpenAI-compatible LLM serving on Ray Serve.",
        version="0.1.0",
    )
    # Added last runs first: the key is checked before a byte of the body is read, then its size.
    if max_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    if allowed_origins:
        # Outside the key check: a browser's preflight carries no Authorization header. The request that
        # follows does, and is checked; its response (a 401 too) carries the CORS headers the browser needs.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    if gate is not None:  # outermost: it counts every request in flight, and turns all away once draining
        app.add_middleware(DrainGate, state=gate)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        service.record_outcome("4xx")  # refused before the service saw it
        sent = request.headers.get("content-type", "")
        if sent and "json" not in sent.split(";")[0]:  # FastAPI reads a body as JSON only when it says so
            return error_response(not_json(sent))
        return error_response(from_validation_errors(exc.errors()))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = OpenAIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request to %s failed", request.url.path)
        return error_response(internal_error())

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(request: CompletionRequest) -> Response:
        """OpenAI text completions."""
        return _to_http(await service.completions(request))

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        """OpenAI chat completions; the prompt is rendered with the tokenizer's chat template."""
        return _to_http(await service.chat_completions(request))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The base model this application serves, and each LoRA adapter on it (`parent`: the base)."""
        return service.models()

    @app.post("/v1/load_lora_adapter", responses=_ERROR_RESPONSES)
    async def load_lora_adapter(request: LoadLoraAdapterRequest) -> PlainTextResponse:
        """Serve a PEFT LoRA adapter by name from now on (vLLM's endpoint); 400 naming what is wrong
        with it (a missing path, a field tandem does not apply, another model's shapes)."""
        return PlainTextResponse(await service.load_lora_adapter(request))

    @app.post("/v1/unload_lora_adapter", responses=_ERROR_RESPONSES)
    async def unload_lora_adapter(request: UnloadLoraAdapterRequest) -> PlainTextResponse:
        """Stop serving a LoRA adapter (404 if it is not served); requests running with it finish."""
        return PlainTextResponse(await service.unload_lora_adapter(request))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        """tandem's Prometheus series (`ray_tandem_*`), as Ray's metrics export port serves them for
        this node (docs/metrics.md)."""
        try:
            return PlainTextResponse(await metrics(), media_type=CONTENT_TYPE)
        except OSError as exc:
            logger.warning("could not read the node's metrics: %s", exc)
            return error_response(unavailable("the metrics exporter of this node cannot be read"))

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> Response:
        """200 when every replica and rank is healthy; 503 with a short reason code otherwise (the
        details are in the replica's log, not for anonymous callers)."""
        return await health_response(service)

    add_vllm_routes(app, service)
    return app
