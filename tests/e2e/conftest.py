"""Shared e2e helpers: a real Ray Serve app on loopback, started once per test module."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServeApp:
    name: str
    base_url: str  # http://127.0.0.1:<port>
    metrics_port: int
    served_model_name: str
    handle: Any  # the app's DeploymentHandle (OpenAIIngress)


@contextlib.contextmanager
def running_serve_app(app_args: dict[str, Any], name: str = "tandem-e2e") -> Iterator[ServeApp]:
    """Ray (8 logical CPUs on a 2-core box, so rank actors fit) + Serve on 127.0.0.1 + the tandem app."""
    import ray
    from ray import serve

    from tandem.deploy.app import build_app
    from tandem.deploy.args import AppArgs

    http_port, metrics_port = free_port(), free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        # Report application metrics every second, so a scrape soon after traffic sees them.
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(app_args), name=name, route_prefix="/")
        handle = serve.get_app_handle(name)  # the public contract, rather than serve.run's return value
        served = AppArgs.model_validate(app_args).resolved_served_model_name()
        yield ServeApp(name, f"http://127.0.0.1:{http_port}", metrics_port, served, handle)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_app_context() -> Callable[..., contextlib.AbstractContextManager[ServeApp]]:
    """`with serve_app_context(app_args) as app:` — for module-scoped fixtures."""
    return running_serve_app


def error_of(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI error object of a body, after checking it has exactly the four keys."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.fixture(scope="session")
def check_error() -> Callable[[dict[str, Any]], dict[str, Any]]:
    return error_of
