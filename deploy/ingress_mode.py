"""How HTTP reaches the LLMServer replicas: through Ray Serve's proxy, or through HAProxy straight to them.

Both are Ray Serve. In `proxy` mode (the default) every request crosses Serve's Python proxy, which
forwards it to a replica as an actor call and relays the streamed response back: a few milliseconds of
time to first token. In `haproxy` mode (Ray's `RAY_SERVE_ENABLE_HA_PROXY`) each replica serves HTTP on
its own port (Serve's direct ingress) and the HAProxy that Ray bundles listens on the app's port and
balances over the replicas, so a request skips the actor hop.

Trade-offs of `haproxy`, which is why it is opt-in: while no replica runs, HAProxy answers a plain-text
503 rather than tandem's shaped one; a replica that dies mid-stream cuts its streams without a final error
chunk (the client sees a broken connection); and Serve keeps a replaced replica draining for 30 s so
HAProxy can drop it. The mode is a cluster setting that Ray's processes read when they start, so it is
put in the environment before `ray.init` (`tandem serve --ingress haproxy`); a cluster started
elsewhere needs it exported where its nodes start.
"""

from __future__ import annotations

from tandem.deploy.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

INGRESS_MODES = ("proxy", "haproxy")
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# HAProxy hands the request body to the prefix router's `/internal/route` (deploy/route_ingress.py); it
# only matters for an app with prefix routing on, whose requests it otherwise routes blind.
ROUTER_BODY_ENV = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"


def ray_environment(mode: str) -> dict[str, str]:
    """Environment variables for the Ray processes of a cluster serving in `mode`."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_MODES)}, got {mode!r}")
    env = {PROXY_CALLBACK_ENV: PROXY_CALLBACK}  # the proxy still serves in haproxy mode, as a fallback
    if mode == "haproxy":
        env[HAPROXY_ENV] = "1"
        env[ROUTER_BODY_ENV] = "1"
    return env
