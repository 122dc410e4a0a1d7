"""API keys: `/v1/*` and vLLM's tokenizer routes (`/tokenize`, `/detokenize`, `/tokenizer_info`) need
`Authorization: Bearer <key>` once any key is configured.

Keys come from `api_key` (the app arg or `--api-key`, one or several) and `TANDEM_API_KEY` (comma
separated). `/health`, `/ping`, `/version`, `/metrics` and the OpenAPI docs stay open: probes and
scrapers carry no key, and none of them runs the model or its tokenizer. The check is an ASGI
middleware around the replica's FastAPI app, so it covers both ingresses (Serve's proxy and HAProxy's
direct ingress reach the same app).

The handle API (`DeploymentHandle` calls) is not checked: a handle only exists inside the Ray cluster,
where a caller can already run any code on the replicas' nodes. Keep the cluster's ports private
(the chart's NetworkPolicy does) and give clients HTTP, not a handle.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.deploy.protocol.errors import OpenAIError
from tandem.engine.environment import api_keys_from_env

PROTECTED_PREFIX = "/v1"
PROTECTED_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


class ApiKeys:
    """The accepted keys. Its repr counts them and never shows one, so no log or traceback leaks a key."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[str]) -> None:
        cleaned = tuple(k.strip() for k in keys if k and k.strip())
        self._keys = tuple(k.encode("utf-8") for k in cleaned)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} key{'s' if len(self._keys) != 1 else ''})"

    __str__ = __repr__

    def accepts(self, token: bytes) -> bool:
        """Constant time in the key that matched: every key is compared, with no early exit."""
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(key, token)
        return matched


def resolve_api_keys(configured: str | Sequence[str] | None) -> ApiKeys:
    """The configured keys plus those in TANDEM_API_KEY; empty when neither sets one (no auth)."""
    if configured is None:
        given: list[str] = []
    elif isinstance(configured, str):
        given = [configured]
    else:
        given = list(configured)
    return ApiKeys([*given, *api_keys_from_env()])


def authentication_error(message: str) -> OpenAIError:
    return OpenAIError(401, message, type="authentication_error", code="invalid_api_key")


class ApiKeyMiddleware:
    """Answers 401 (OpenAI's shape) to a protected request without a valid bearer key; passes the rest."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not _protected(scope):
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        error = authentication_error(problem)
        body = json.dumps(error.body()).encode("utf-8")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"www-authenticate", b'Bearer realm="tandem"'),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _problem(self, scope: Scope) -> str | None:
        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        if not values:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = values[0].strip().partition(b" ")
        token = token.strip()
        if len(values) > 1 or scheme.lower() != b"bearer" or not token or b" " in token:
            return "malformed Authorization header: expected 'Bearer <key>'"
        if not self.keys.accepts(token):
            return "invalid API key"  # never echo the token: it may be a real key of another service
        return None


def _protected(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):  # mounted under a route prefix: check the app's own route
        path = path[len(root) :]
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_ROUTES
