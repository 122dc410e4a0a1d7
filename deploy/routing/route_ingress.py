"""`PrefixRouteIngress`: where HAProxy asks which LLMServer replica should take a request.

With the HAProxy ingress, HAProxy balances straight to the replicas' own HTTP ports, bypassing Serve's
request router. Ray 2.60 closes that gap with an "ingress request router" peer deployment
(`Application._with_ingress_request_router`, the hook Ray Serve LLM's direct streaming uses): for each
POST, HAProxy's Lua action sends the body to this deployment's `/internal/route`, which runs the
LLMServer deployment's own request router (`PrefixAffinityRouter`) in pick-only mode and answers the
chosen replica; HAProxy then forwards the request there unchanged. The request itself still takes one
hop; the routing call is a small local HTTP exchange beside it (docs/serve-config.md#prefix-routing).

HAProxy forwards the body only when `RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1` is set where
Ray's processes start (`routing/ingress_mode.py`); without it every request falls back to load balancing.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle


def routing_body(raw: bytes) -> dict[str, Any] | None:
    """The parsed JSON object of a request body, or None (empty, truncated by HAProxy, not an object)."""
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def build_route_app(pick: Callable[[dict[str, Any] | None], Awaitable[dict[str, Any]]]) -> FastAPI:
    """The `/internal/route` app. A module function, not a closure in the deployment class: Serve ships
    the class by value, and FastAPI would then miss the annotations' names (`Request`) in its globals."""
    app = FastAPI()

    @app.post("/internal/route")
    async def route(request: Request) -> dict[str, Any]:
        return await pick(routing_body(await request.body()))

    return app


@serve.deployment(
    # It sits beside HAProxy on every request: never the bottleneck, and schedulable on any node.
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
)
@serve.ingress()
class PrefixRouteIngress:
    def __init__(self, server: DeploymentHandle[Any]) -> None:
        self._server = server

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_route_app(self.pick)

    async def pick(self, body: dict[str, Any] | None) -> dict[str, Any]:
        """`{"host", "port", "replica_id"}` of the replica the LLMServer's router picks for `body`.

        Pick-only (`_reserve=False`): the request goes out through HAProxy, so no slot is reserved on
        the replica. Any non-200 answer makes HAProxy reply 503.
        """
        args = (body,) if body is not None else ()
        try:
            async with self._server.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise HTTPException(503, f"replica {selection.replica_id} has no HTTP port")
                host, port = endpoint
                return {"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()}
        except DeploymentUnavailableError as exc:
            raise HTTPException(503, str(exc)) from None
