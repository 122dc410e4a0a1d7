"""`OpenAIIngress`: the app's ingress deployment, serving HTTP and the Python handle API.

HTTP goes through the FastAPI app built per replica by `__serve_build_asgi_app__`. The handle methods
(`completions`, `chat_completions`, `stats`, `models`) take the same JSON bodies as the routes and return
the same dicts, errors included (`{"error": {...}}`, as the HTTP body would be). With
`handle.options(stream=True)` and `"stream": true` they yield the chunk dicts; a request that fails
before streaming yields its error dict alone.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from tandem.deploy.errors import OpenAIError, from_validation_errors
from tandem.deploy.handle_backend import HandleBackend
from tandem.deploy.http import build_http_app
from tandem.deploy.protocol import ChatCompletionRequest, CompletionRequest
from tandem.deploy.service import OpenAIService, Response

RequestT = TypeVar("RequestT", bound=BaseModel)


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(
        self, llm_server: DeploymentHandle[Any], served_model_name: str, model_root: str | None = None
    ) -> None:
        self._service = OpenAIService(HandleBackend(llm_server), served_model_name, model_root)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self._service)

    async def completions(self, body: dict[str, Any]) -> Response:
        return await self._call(body, CompletionRequest, self._service.completions)

    async def chat_completions(self, body: dict[str, Any]) -> Response:
        return await self._call(body, ChatCompletionRequest, self._service.chat_completions)

    async def stats(self) -> dict[str, Any]:
        """The `LLM.stats()` keys summed over every LLMServer replica, plus `num_replicas`."""
        return await self._service.stats()

    async def models(self) -> dict[str, Any]:
        return self._service.models()

    async def _call(
        self,
        body: dict[str, Any],
        request_cls: type[RequestT],
        method: Callable[[RequestT], Awaitable[Response]],
    ) -> Response:
        streaming = isinstance(body, dict) and body.get("stream") is True
        try:
            return await method(request_cls.model_validate(body))
        except ValidationError as exc:
            error = from_validation_errors(exc.errors())
        except OpenAIError as exc:
            error = exc
        # Serve needs a generator for a stream=True call and a plain value otherwise.
        return _yield_once(error.body()) if streaming else error.body()


async def _yield_once(item: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
    yield item
