"""Faults and shutdowns under load on a CPU Serve app (tiny Qwen3, one TP=2 replica).

- A rank actor dies, then the replica actor: every in-flight request ends with an error within 10 s,
  `/health` turns 503, Serve replaces the replica with a fresh TP group, `/health` is 200 again and
  requests succeed. The recovery times go into the reliability figures.
- The replica is replaced by a redeploy, then the app is deleted, each during load: running requests
  drain to completion, and nothing is cut without an error.

The tests run in file order and each leaves the app serving, except the last, which deletes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray
from ray import serve

from tandem.deploy.app import build_app

MAX_ONGOING, MAX_QUEUED = 16, 16
IN_FLIGHT = 6  # long requests running when the fault hits
LOAD_WORKERS = 3  # clients sending short requests all through each fault and recovery
ERROR_WITHIN_S = 10.0  # the longest an in-flight request may take to fail when its rank dies
RECOVERY_BOUND_S = 90.0  # Serve's health checks (3 x 2 s) + a new TP=2 replica, with a wide margin
DRAINED_AFTER_S = 1.0  # in-flight requests must outlive the start of a shutdown by this much
APP_NAME = "tandem-chaos"
HEALTH_WITHIN_S = 1.0
INTERNAL_DETAIL = re.compile(r"\d+\.\d+\.\d+\.\d+|\]:\d+|\.(?:cc|cpp|py)\b|/[a-z_]+/[a-z_]+")


@dataclass(frozen=True)
class ChaosApp:
    running: Any  # conftest.ServeApp
    args: dict[str, Any]


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[ChaosApp]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-chaos",
        "tp_size": 2,  # so a dead rank takes a TP peer with it, and the restart is a gang restart
        "device": "cpu",
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
    }
    with serve_app_context(args, name=APP_NAME) as running:
        yield ChaosApp(running, args)


@dataclass
class Traffic:
    """Long requests in flight when the fault hits, plus short ones sent all through it."""

    in_flight: list[asyncio.Task[Any]] = field(default_factory=list)
    load: list[tuple[float, Any]] = field(default_factory=list)  # (start time, outcome)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    workers: list[asyncio.Task[None]] = field(default_factory=list)

    async def finish(self, timeout_s: float = 90.0) -> list[Any]:
        """Stop the load and collect the in-flight outcomes (each already bounded by its own timeout)."""
        self.stop.set()
        done = await asyncio.wait_for(asyncio.gather(*self.in_flight, *self.workers), timeout_s)
        return list(done[: len(self.in_flight)])


async def start_traffic(
    app: ChaosApp, session: Any, openai_call: Callable[..., Any], max_tokens: int
) -> Traffic:
    traffic = Traffic()
    for i in range(IN_FLIGHT):
        body = {
            "prompt": f"in flight {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        traffic.in_flight.append(asyncio.create_task(openai_call(session, "/v1/completions", body)))

    async def worker(w: int) -> None:
        for i in range(10_000):  # bounded; `stop` ends it long before
            if traffic.stop.is_set():
                return
            body = {"prompt": f"load {w}.{i}", "max_tokens": 8, "stream": i % 2 == 0}
            started = time.monotonic()
            outcome = await openai_call(session, "/v1/completions", body)
            traffic.load.append((started, outcome))
            if not outcome.complete:
                await asyncio.sleep(0.2)  # back off, as a client would, rather than spin on fast errors

    traffic.workers = [asyncio.create_task(worker(w)) for w in range(LOAD_WORKERS)]
    # The fault must hit requests that are really running on the ranks, not still being routed.
    deadline = time.monotonic() + 30.0
    while (await app.running.handle.stats.remote()).get("num_running", 0) < IN_FLIGHT:
        assert time.monotonic() < deadline, "the in-flight requests never all started"
        await asyncio.sleep(0.1)
    return traffic


def assert_no_cuts(outcomes: list[Any]) -> None:
    """Each request got a complete answer or an explicit error; none was cut silently or hung."""
    problems = [o.problem for o in outcomes if o.problem is not None]
    assert not problems, problems[:5]
    assert all(o.complete or o.explicit_error for o in outcomes), [o for o in outcomes if not o.complete][:3]
    server_errors = {o.status for o in outcomes if o.status is not None and o.status >= 500}
    assert server_errors <= {503}, f"only 503 may say the server failed, got {server_errors}"


async def watch_recovery(session: Any, killed: float, check_error: Callable[..., Any]) -> dict[str, float]:
    """Poll /health until it has been 503 and is 200 again, then until a completion succeeds."""
    seen: dict[str, float] = {"health_call_s_max": 0.0}
    while "health_200_s" not in seen:
        elapsed = time.monotonic() - killed
        assert elapsed < RECOVERY_BOUND_S, f"no recovery within {RECOVERY_BOUND_S:g}s: {seen}"
        asked = time.monotonic()
        async with session.get("/health") as health:
            status, body = health.status, await health.read()
        seen["health_call_s_max"] = max(seen["health_call_s_max"], time.monotonic() - asked)
        if status == 200:
            if "health_503_s" in seen:
                seen["health_200_s"] = elapsed
        else:
            assert status == 503, body
            assert check_error(json.loads(body))["code"] == "unhealthy", body
            seen.setdefault("health_503_s", elapsed)
        await asyncio.sleep(0.2)
    while True:
        elapsed = time.monotonic() - killed
        assert elapsed < RECOVERY_BOUND_S, f"no successful completion within {RECOVERY_BOUND_S:g}s"
        async with session.post("/v1/completions", json={"prompt": "recovered?", "max_tokens": 4}) as answer:
            status = answer.status
            await answer.read()
        if status == 200:
            seen["first_success_s"] = elapsed
            return seen
        await asyncio.sleep(0.2)


def chaos_round(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    check_error: Callable[..., Any],
    kill: Callable[[], None],
) -> dict[str, Any]:
    async def run() -> tuple[list[Any], list[tuple[float, Any]], float, dict[str, float]]:
        async with open_session(app.running.base_url) as session:
            traffic = await start_traffic(app, session, openai_call, max_tokens=1900)
            kill()
            killed = time.monotonic()
            recovery = await watch_recovery(session, killed, check_error)
            # Requests sent once the new replica serves must succeed, so run the load on a little.
            await asyncio.sleep(2.0)
            in_flight = await traffic.finish()
            return in_flight, traffic.load, killed, recovery

    in_flight, load, killed, recovery = asyncio.run(run())
    assert_no_cuts(in_flight + [o for _, o in load])
    # 1900 tokens take far longer than ERROR_WITHIN_S, so an in-flight request ending in time ended
    # because of the fault, and must say so.
    assert all(o.explicit_error for o in in_flight), [o for o in in_flight if not o.explicit_error]
    error_after = max(o.ended_at - killed for o in in_flight)
    assert error_after < ERROR_WITHIN_S, f"an in-flight request took {error_after:.1f}s to fail"
    # Through the restart, a probe learns the state within a second (a load balancer's probe timeout).
    assert recovery["health_call_s_max"] < HEALTH_WITHIN_S, recovery
    # The client is told what failed and a request id to find it by; internal addresses, ports and
    # source paths stay in the server log.
    for message in (o.error["message"] for o in in_flight if o.error is not None):
        assert not INTERNAL_DETAIL.search(message), message
    assert any("request id " in o.error["message"] for o in in_flight if o.error), in_flight[:2]
    after_recovery = [o for start, o in load if start > killed + recovery["first_success_s"]]
    assert after_recovery and all(o.complete for o in after_recovery), after_recovery[:3]
    return {
        "in_flight_error_s_max": round(error_after, 3),
        **{k: round(v, 2) for k, v in recovery.items()},
        "in_flight": len(in_flight),
        "load_requests": len(load),
        "load_errors": sum(1 for _, o in load if o.explicit_error),
    }


def test_a_killed_rank_fails_in_flight_requests_and_serve_replaces_the_tp_group(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    check_error: Callable[..., Any],
    ray_actors: Any,
    reliability_figures: dict[str, Any],
) -> None:
    ranks = ray_actors.alive("RankWorker")
    assert len(ranks) == 2

    def kill_rank() -> None:
        # SIGKILL to the rank's worker process: what `ray.kill` does to an actor, and what an OOM kill
        # or a segfault look like. `ray.kill` itself needs a handle, and only the replica holds those.
        os.kill(max(ranks.values()), signal.SIGKILL)

    figures = chaos_round(app, openai_call, open_session, check_error, kill_rank)
    reliability_figures["chaos_kill_rank"] = figures
    print(f"\nrank kill figures: {json.dumps(figures)}")
    new_ranks = ray_actors.alive("RankWorker")
    assert len(new_ranks) == 2 and not set(new_ranks) & set(ranks), "the TP group was not replaced whole"


def test_a_killed_replica_actor_fails_in_flight_requests_and_is_replaced(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    check_error: Callable[..., Any],
    ray_actors: Any,
    reliability_figures: dict[str, Any],
) -> None:
    replicas = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP_NAME}#LLMServer#" in a["name"]
    ]
    assert len(replicas) == 1
    old_ranks = ray_actors.alive("RankWorker")

    def kill_replica() -> None:
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]))

    figures = chaos_round(app, openai_call, open_session, check_error, kill_replica)
    reliability_figures["chaos_kill_replica"] = figures
    print(f"\nreplica kill figures: {json.dumps(figures)}")
    # The rank actors died with the replica that owned them (Ray's fate sharing); new ones serve now.
    new_ranks = ray_actors.alive("RankWorker")
    assert len(new_ranks) == 2 and not set(new_ranks) & set(old_ranks)


# ---- graceful shutdown under load ------------------------------------------------------------------


def shutdown_round(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    action: Callable[[], None],
) -> tuple[list[Any], list[tuple[float, Any]], float, float]:
    """Run `action` (blocking Serve calls) in a thread during load; the in-flight and load outcomes."""

    async def run() -> tuple[list[Any], list[tuple[float, Any]], float, float]:
        async with open_session(app.running.base_url) as session:
            # 200 tokens: seconds of work, so the shutdown surely starts while they run, yet far below the
            # 40 s graceful-shutdown budget the drain may use.
            traffic = await start_traffic(app, session, openai_call, max_tokens=200)
            started = time.monotonic()
            done = threading.Event()
            failures: list[BaseException] = []

            def act() -> None:
                try:
                    action()
                except BaseException as exc:  # re-raised below, in the test's thread
                    failures.append(exc)
                finally:
                    done.set()

            threading.Thread(target=act, daemon=True).start()
            while not done.is_set():
                assert time.monotonic() - started < 120.0, "the shutdown did not finish in 120 s"
                await asyncio.sleep(0.2)
            if failures:
                raise failures[0]
            took = time.monotonic() - started
            in_flight = await traffic.finish()
            return in_flight, traffic.load, started, took

    return asyncio.run(run())


def test_a_redeploy_during_load_drains_the_old_replica(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    ray_actors: Any,
    reliability_figures: dict[str, Any],
) -> None:
    old_replica = ray_actors.alive("LLMServer")

    def redeploy() -> None:
        # serve.run gives the code a new version, so Serve starts a new replica and then shuts the old
        # one down gracefully: the same path as a scale-down or a rolling update.
        serve.run(build_app(app.args), name=APP_NAME, route_prefix="/")

    in_flight, load, started, took = shutdown_round(app, openai_call, open_session, redeploy)
    new_replica = ray_actors.alive("LLMServer")
    assert len(new_replica) == 1 and not set(new_replica) & set(old_replica), "the replica was not replaced"
    assert_no_cuts(in_flight + [o for _, o in load])
    # Running requests drain: they finish, rather than merely fail cleanly.
    assert all(o.complete for o in in_flight), [o.error for o in in_flight if not o.complete]
    # And they were still running well after Serve began to stop the old replica (its controller stops
    # outdated replicas first, within a loop of a tenth of a second), so they really were drained.
    assert min(o.ended_at for o in in_flight) > started + DRAINED_AFTER_S
    figures = {
        "redeploy_s": round(took, 1),
        "in_flight_completed": sum(o.complete for o in in_flight),
        "in_flight_s_max": round(max(o.seconds for o in in_flight), 2),
        "load_requests": len(load),
        "load_complete": sum(1 for _, o in load if o.complete),
        "load_errors": sum(1 for _, o in load if o.explicit_error),
    }
    reliability_figures["shutdown_redeploy"] = figures
    print(f"\nredeploy figures: {json.dumps(figures)}")


def test_deleting_the_app_during_load_drains_running_requests(
    app: ChaosApp,
    openai_call: Callable[..., Any],
    open_session: Callable[..., Any],
    reliability_figures: dict[str, Any],
) -> None:
    in_flight, load, started, took = shutdown_round(
        app, openai_call, open_session, lambda: serve.delete(APP_NAME)
    )
    assert_no_cuts(in_flight)
    assert all(o.complete for o in in_flight), [o.error for o in in_flight if not o.complete]
    assert min(o.ended_at for o in in_flight) > started + DRAINED_AFTER_S
    # Once the app is gone the proxy itself answers, in plain text (404: no route): an explicit
    # status, not tandem's error shape. Before that, load requests complete or fail explicitly.
    gone = [o for _, o in load if o.status == 404 and o.error is None]
    assert_no_cuts([o for _, o in load if not (o.status == 404 and o.error is None)])
    assert all(o.ended_at > started for o in gone)
    figures = {
        "delete_s": round(took, 1),
        "in_flight_completed": sum(o.complete for o in in_flight),
        "in_flight_s_max": round(max(o.seconds for o in in_flight), 2),
        "load_requests": len(load),
        "load_complete": sum(1 for _, o in load if o.complete),
        "load_after_delete_404": len(gone),
    }
    reliability_figures["shutdown_delete"] = figures
    print(f"\ndelete figures: {json.dumps(figures)}")
