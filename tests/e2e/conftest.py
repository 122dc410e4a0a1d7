"""Shared e2e helpers: a real Ray Serve app on loopback, started once per test module. Every test under
tests/e2e is marked `e2e` (it starts Ray), so `pytest -m "not e2e and not gpu"` is the fast loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items, so mark only the ones under this folder.
    for item in items:
        if _E2E_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


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
    handle: Any  # the app's DeploymentHandle (LLMServer, the app's ingress)


@contextlib.contextmanager
def running_serve_app(app_args: dict[str, Any], name: str = "tandem-e2e") -> Iterator[ServeApp]:
    """Ray (8 logical CPUs on a 2-core box, so rank actors fit) + Serve on 127.0.0.1 + the tandem app."""
    import ray
    from ray import serve

    from tandem.deploy.app import build_app
    from tandem.deploy.config.args import AppArgs
    from tandem.deploy.routing.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    http_port, metrics_port = free_port(), free_port()
    # As `tandem serve` and the Helm chart do: the proxy, started by this Ray, shapes replica failures.
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
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


# ---- reliability: outcomes, Ray actor processes and measured figures -------------------------------


@dataclass
class Outcome:
    """How one HTTP request ended, as the client saw it.

    `complete`: a 200 whose every choice finished ("stop"/"length"), and for a stream, `data: [DONE]`.
    `explicit_error`: an OpenAI-shaped error, as the body of a non-200 or as a stream's error chunk.
    Anything else (a stream cut without an error, a body that is not the OpenAI shape, a hang, a reset
    connection) is a `problem`: what the reliability tests must never see.
    """

    status: int | None = None
    seconds: float = 0.0
    ended_at: float = 0.0  # time.monotonic() when it ended
    done: bool = False  # `data: [DONE]` seen, or a JSON body read
    error: dict[str, Any] | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    closed_by_client: bool = False
    problem: str | None = None

    @property
    def complete(self) -> bool:
        finished = bool(self.finish) and all(r in ("stop", "length") for r in self.finish.values())
        return self.status == 200 and self.error is None and self.done and finished

    @property
    def explicit_error(self) -> bool:
        return self.error is not None and self.problem is None


def _take_choices(outcome: Outcome, body: dict[str, Any], streamed: bool) -> None:
    for choice in body.get("choices") or []:
        index = int(choice["index"])
        if "text" in choice:
            piece = choice["text"]
        elif streamed:
            piece = (choice.get("delta") or {}).get("content")
        else:
            piece = (choice.get("message") or {}).get("content")
        outcome.texts[index] = outcome.texts.get(index, "") + (piece or "")
        if choice.get("finish_reason") is not None or index not in outcome.finish:
            outcome.finish[index] = choice.get("finish_reason")
    if body.get("usage"):
        outcome.usage = body["usage"]


async def call_openai(
    session: Any,
    path: str,
    body: dict[str, Any] | bytes,
    *,
    close_after_chunks: int | None = None,
    timeout_s: float = 60.0,
) -> Outcome:
    """POST a body (a dict, or raw bytes for malformed JSON) and classify how it ended; never raises.

    `session` is an `aiohttp.ClientSession` with the app's base URL: far lighter per request than httpx,
    which matters on 2 cores, where the client shares the CPU with the server it measures. With
    `close_after_chunks`, the client reads that many stream chunks and then closes the connection
    (a client going away mid-stream). `timeout_s` bounds the whole exchange: past it, the outcome is a
    problem ("hang"), not an exception, so one stuck request cannot stall a test's other checks.
    """
    import json

    outcome = Outcome()
    start = time.monotonic()
    if isinstance(body, bytes):
        kwargs: dict[str, Any] = {"data": body, "headers": {"content-type": "application/json"}}
    else:
        kwargs = {"json": body}

    async def exchange() -> None:
        async with session.post(path, **kwargs) as response:
            outcome.status = response.status
            if response.content_type != "text/event-stream":
                raw = await response.read()
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    outcome.problem = f"HTTP {response.status} with a non-JSON body: {raw[:120]!r}"
                    return
                outcome.done = True
                if response.status != 200:
                    outcome.error = _error_or_none(parsed)
                    if outcome.error is None:
                        outcome.problem = f"HTTP {response.status} without an OpenAI error: {parsed}"
                    return
                _take_choices(outcome, parsed, streamed=False)
                return
            chunks = 0
            async for raw_line in response.content:
                line = raw_line.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                if outcome.done:
                    outcome.problem = "data after [DONE]"
                    return
                if line == "data: [DONE]":
                    outcome.done = True
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    outcome.error = _error_or_none(chunk)
                    if outcome.error is None:
                        outcome.problem = f"a malformed error chunk: {chunk}"
                    continue
                if outcome.error is not None:
                    outcome.problem = "a chunk after the error chunk"
                    return
                _take_choices(outcome, chunk, streamed=True)
                chunks += 1
                if close_after_chunks is not None and chunks >= close_after_chunks:
                    outcome.closed_by_client = True
                    # Leaving the `async with` with the body unread closes the connection mid-stream.
                    return
            if not outcome.done:
                outcome.problem = "the stream ended without data: [DONE]"

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        outcome.problem = f"hang: no end within {timeout_s:g}s"
    except Exception as exc:  # a reset or refused connection: cut without an error
        outcome.problem = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic()
    outcome.seconds = outcome.ended_at - start
    if (
        outcome.status == 200
        and outcome.problem is None
        and outcome.error is None
        and not (outcome.closed_by_client or outcome.complete)
    ):
        outcome.problem = f"a 200 whose choices did not all finish: {outcome.finish}"
    return outcome


def http_session(base_url: str, connections: int = 64, timeout_s: float = 120.0) -> Any:
    """An aiohttp session for `call_openai`; use as `async with http_session(app.base_url) as session`."""
    import aiohttp

    return aiohttp.ClientSession(
        base_url=base_url,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


def _error_or_none(body: Any) -> dict[str, Any] | None:
    try:
        return error_of(body)
    except AssertionError:
        return None


@pytest.fixture(scope="session")
def openai_call() -> Callable[..., Any]:
    """`await openai_call(session, path, body, close_after_chunks=None, timeout_s=60) -> Outcome`."""
    return call_openai


@pytest.fixture(scope="session")
def open_session() -> Callable[..., Any]:
    """`async with open_session(app.base_url, connections=64) as session:` for `openai_call`."""
    return http_session


class RayActors:
    """This test's Ray actors by class name, and their processes' memory.

    The public state API (`ray.util.state`) needs the dashboard, which the e2e clusters run without, so
    this reads the GCS actor table through `ray._private.state`, as `ray list actors` does underneath.
    """

    @staticmethod
    def alive(class_name: str) -> dict[str, int]:
        """Actor id (hex) -> PID of every ALIVE actor whose class name contains `class_name`."""
        import ray._private.state

        table = ray._private.state.actors()
        return {
            actor_id: int(actor["Pid"])
            for actor_id, actor in table.items()
            if actor["State"] == "ALIVE" and class_name in actor["ActorClassName"]
        }

    @staticmethod
    def rss_mib(pid: int) -> float:
        """Resident set size from /proc (Linux), in MiB."""
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="session")
def ray_actors() -> type[RayActors]:
    return RayActors


@pytest.fixture(scope="session")
def reliability_figures() -> Iterator[dict[str, Any]]:
    """Figures the reliability tests measured, by test. Written as JSON to $TANDEM_RELIABILITY_JSON at
    the end of the session when that is set (docs/reliability.md quotes such a file)."""
    import json
    import os
    import platform

    figures: dict[str, Any] = {}
    yield figures
    target = os.environ.get("TANDEM_RELIABILITY_JSON")
    if target and figures:
        from tandem.benchmarks.common import git_commit

        machine = {
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "commit": git_commit(),
        }
        Path(target).write_text(json.dumps({"machine": machine, **figures}, indent=2, sort_keys=True) + "\n")
