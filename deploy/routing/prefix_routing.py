"""How `build_app` wires prefix-cache-aware routing and the autoscaling target (docs/serve-config.md).

With several replicas, the LLMServer deployment gets `PrefixAffinityRouter` as its Serve request router.
Under the HAProxy ingress, whose traffic bypasses Serve's router, the app also gets the
`PrefixRouteIngress` peer that HAProxy consults per request; Ray refuses a custom router on an HAProxy
ingress without one, and refuses the peer without HAProxy, so both follow Ray's own ingress setting.
Through Serve's Python proxy the router sees the HTTP request before its body is read (the proxy passes
the replica only the ASGI scope), so HTTP requests there fall back to power-of-two choices; handle calls
carry their body and route on it in either mode.
"""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application
from ray.serve.deployment import Deployment

from tandem.deploy.config.args import AppArgs
from tandem.deploy.config.capacity import replica_capacity

ROUTER_CLASS = "tandem.deploy.routing.prefix_router:PrefixAffinityRouter"
ONGOING_STAT = "ongoing"  # the key of `LLMServer.record_routing_stats` that the router reads
# How often Serve asks each replica for its `record_routing_stats` (the load the router reads when it
# has no fresher probe, as on HAProxy's pick-only path): one small RPC per replica per period.
ROUTING_STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 5.0


def prefix_routing_enabled(args: AppArgs) -> bool:
    """`prefix_routing` when set; otherwise on with more than one replica, or with autoscaling."""
    if args.prefix_routing is not None:
        return args.prefix_routing
    return (args.num_replicas or 1) > 1 or args.autoscaling_config is not None


def request_router_config(args: AppArgs, device: str) -> dict[str, Any]:
    """Serve's `request_router_config` for the LLMServer deployment.

    The affine replica may run up to half a replica's capacity more requests than the least loaded one
    before the router sends the prompt there instead (SGLang's cache-aware router defaults to 32).
    """
    return {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {
            "imbalanced_threshold": max(1.0, replica_capacity(args, device) / 2),
            "served_model_name": args.resolved_served_model_name(),
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": ROUTING_STATS_TIMEOUT_S,
    }


def autoscaling_config(args: AppArgs, device: str) -> dict[str, Any] | None:
    """Serve's `autoscaling_config`, with `target_ongoing_requests` derived when unset.

    Serve counts a replica's ongoing requests, those waiting in its admission queue included; the target
    is the replica's capacity, so replicas are added once the running batches are full on average rather
    than once requests queue. The other fields pass through as given.
    """
    if args.autoscaling_config is None:
        return None
    config = args.autoscaling_config.to_serve_config()
    config.setdefault("target_ongoing_requests", float(replica_capacity(args, device)))
    return config


def haproxy_ingress() -> bool:
    """Whether Ray's HAProxy is the ingress: Ray's own setting, read as its `build_app` reads it."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    return bool(RAY_SERVE_ENABLE_HA_PROXY)


def with_route_ingress(app: Application, args: AppArgs) -> Application:
    """`app` with the `PrefixRouteIngress` peer attached, when routing is on and HAProxy is the ingress."""
    if not (prefix_routing_enabled(args) and haproxy_ingress()):
        return app
    from tandem.deploy.routing.route_ingress import PrefixRouteIngress

    return app._with_ingress_request_router(cast(Deployment, PrefixRouteIngress).bind(app))
