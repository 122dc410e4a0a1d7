"""Prefix-cache-aware routing: what the router routes on, how it picks, and how the app wires it in.

The router runs here over fake replicas (no Ray cluster): Serve hands a router `RunningReplica`s and
`PendingRequest`s, and the fakes carry only what the router reads. The e2e measure of the cache hits it
buys is tests/e2e/test_prefix_routing.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from tandem.deploy.app import build_app, llm_server_options
from tandem.deploy.config.args import AppArgs, AutoscalingArgs
from tandem.deploy.routing import prefix_routing
from tandem.deploy.routing.prefix_router import PrefixAffinityRouter, routing_text
from tandem.deploy.routing.prefix_routing import (
    ROUTER_CLASS,
    autoscaling_config,
    prefix_routing_enabled,
    with_route_ingress,
)

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="tandem")


class FakeReplica:
    """What the router reads of a Serve `RunningReplica`."""

    def __init__(self, name: str, ongoing: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats: dict[str, Any] = {"ongoing": ongoing}
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 1000

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(3600)  # no probe answers: the router reads `routing_stats`, as on HAProxy's path
        return 0


def _request(body: Any) -> PendingRequest:
    return PendingRequest(args=[body], kwargs={}, metadata=SimpleNamespace(multiplexed_model_id=""))  # type: ignore[arg-type]


async def _router(replicas: list[FakeReplica], **kwargs: Any) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    return router


async def _route(router: PrefixAffinityRouter, replicas: list[FakeReplica], body: Any) -> str:
    ranks = await router.choose_replicas(replicas, _request(body))  # type: ignore[arg-type]
    return str(ranks[0][0].replica_id.unique_id)


async def _new_tenants(
    router: PrefixAffinityRouter, replicas: list[FakeReplica], name: str, n: int
) -> list[str]:
    """Where `n` requests with new ~200-character prefixes go, one after another."""
    return [await _route(router, replicas, {"prompt": f"{name} {p}: " + "policy " * 30}) for p in range(n)]


def test_routing_text_reads_prompts_and_messages() -> None:
    assert routing_text([{"prompt": "You are terse. Hi"}]) == "You are terse. Hi"
    assert routing_text([{"prompt": ["first", "second"]}]) == "first"
    assert routing_text([{"prompt": [5, 17, 3]}]) == "5,17,3,"
    assert routing_text([{"prompt": [[5, 17], [9]]}]) == "5,17,"
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url"}]},
    ]
    assert routing_text([{"messages": chat}]) == "Be brief.Hello"
    assert routing_text([SimpleNamespace(messages=chat)]) == "Be brief.Hello"  # Ray Serve LLM's form
    # The proxy's unparsed HTTP request, a stats call, an empty prompt: nothing to route on.
    assert routing_text([b"\x80\x04pickled-scope"]) is None
    assert routing_text([]) is None
    assert routing_text([{"prompt": ""}]) is None


def test_shared_prefixes_stick_to_one_replica_and_spread_over_both() -> None:
    async def run() -> dict[int, set[str]]:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router = await _router(replicas)
        seen: dict[int, set[str]] = {}
        for i in range(6 * 8):  # 8 prefixes, interleaved
            prefix = f"system prompt number {i % 8}: " + "context " * 40
            seen.setdefault(i % 8, set()).add(await _route(router, replicas, {"prompt": f"{prefix}q{i}"}))
        return seen

    seen = asyncio.run(run())
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    counts = [sum(1 for r in seen.values() if r == {name}) for name in ("a", "b")]
    assert counts == [4, 4], seen  # a new prefix goes where the least is cached


def test_an_overloaded_affine_replica_is_passed_over() -> None:
    async def run() -> tuple[str, str, str]:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router = await _router(replicas, imbalanced_threshold=4)
        body = {"messages": [{"role": "system", "content": "shared " * 50}, {"role": "user", "content": "x"}]}
        first = await _route(router, replicas, body)
        by_name = {r.replica_id.unique_id: r for r in replicas}
        by_name[first].routing_stats = {"ongoing": 4}  # at the threshold: affinity holds
        held = await _route(router, replicas, body)
        by_name[first].routing_stats = {"ongoing": 5}  # past it: the least loaded takes it
        moved = await _route(router, replicas, body)
        return first, held, moved

    first, held, moved = asyncio.run(run())
    assert held == first and moved != first


def test_new_prefixes_spread_evenly_whatever_was_cached_before() -> None:
    async def run() -> list[str]:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router = await _router(replicas)
        for i in range(20):  # unrelated traffic, all on one replica (its prompts match each other)
            await _route(router, replicas, {"prompt": f"health probe {i:02d} of the service"})
        return await _new_tenants(router, replicas, "tenant", 8)  # before any load report shows them

    picks = asyncio.run(run())
    # The probes' family counts as one prefix on "a": nine prefixes, five and four.
    assert sorted(picks) == ["a"] * 3 + ["b"] * 5, picks


def test_a_stale_load_report_does_not_send_a_burst_of_new_prefixes_to_one_replica() -> None:
    async def run() -> list[str]:
        # "b" last reported the one request it was running a second ago; "a" reported none.
        replicas = [FakeReplica("a"), FakeReplica("b", ongoing=1)]
        router = await _router(replicas)
        return await _new_tenants(router, replicas, "tenant", 8)

    picks = asyncio.run(run())
    # Load first would put all eight on "a", whose cache then holds every prefix; the difference of one
    # request is far below the imbalance threshold, so the prefixes spread four and four.
    assert sorted(picks) == ["a"] * 4 + ["b"] * 4, picks


def test_a_replica_added_later_takes_its_share_of_new_prefixes_not_all() -> None:
    async def run() -> list[str]:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router = await _router(replicas)
        await _new_tenants(router, replicas, "early tenant", 10)
        replicas.append(FakeReplica("c"))  # an autoscaled replica joins
        router.update_replicas(replicas)  # type: ignore[arg-type]
        return await _new_tenants(router, replicas, "late tenant", 6)

    picks = asyncio.run(run())
    assert sorted(picks) == ["a"] * 2 + ["b"] * 2 + ["c"] * 2, picks


def test_requests_without_a_prompt_get_two_choices_least_loaded_first() -> None:
    async def run() -> list[list[str]]:
        replicas = [FakeReplica("a", ongoing=3), FakeReplica("b", ongoing=1)]
        router = await _router(replicas)
        ranks = await router.choose_replicas(replicas, _request(b"raw"))  # type: ignore[arg-type]
        return [[str(r.replica_id.unique_id) for r in rank] for rank in ranks]

    assert asyncio.run(run()) == [["b", "a"]]


def test_routing_is_on_with_several_replicas_and_off_by_the_setting() -> None:
    assert not prefix_routing_enabled(AppArgs())
    assert prefix_routing_enabled(AppArgs(num_replicas=2))
    assert prefix_routing_enabled(AppArgs(autoscaling_config=AutoscalingArgs(max_replicas=3)))
    assert not prefix_routing_enabled(AppArgs(num_replicas=2, prefix_routing=False))
    assert prefix_routing_enabled(AppArgs(prefix_routing=True))
    options = llm_server_options(AppArgs(num_replicas=2, max_ongoing_requests=48), "cpu")
    config = options["request_router_config"]
    assert config["request_router_class"] == ROUTER_CLASS
    assert config["request_router_kwargs"] == {"imbalanced_threshold": 24.0}
    assert "request_router_config" not in llm_server_options(AppArgs(), "cpu")
    off = AppArgs(num_replicas=2, prefix_routing=False)
    assert "request_router_config" not in llm_server_options(off, "cpu")


def test_autoscaling_target_is_the_replica_capacity_unless_set() -> None:
    derived = AppArgs(max_ongoing_requests=48, autoscaling_config=AutoscalingArgs(max_replicas=4))
    expected = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 48.0}
    assert autoscaling_config(derived, "cpu") == expected
    given = AutoscalingArgs(max_replicas=4, target_ongoing_requests=5, upscale_delay_s=1, downscale_delay_s=2)
    config = autoscaling_config(AppArgs(autoscaling_config=given), "cpu")
    assert config is not None
    delays = (config["upscale_delay_s"], config["downscale_delay_s"])
    assert config["target_ongoing_requests"] == 5 and delays == (1, 2)
    assert llm_server_options(derived, "cpu")["autoscaling_config"]["target_ongoing_requests"] == 48.0
    assert autoscaling_config(AppArgs(), "cpu") is None
    # Unset, the capacity is the engine's: 64 on CPU.
    unset = AppArgs(autoscaling_config=AutoscalingArgs(max_replicas=4))
    assert autoscaling_config(unset, "cpu")["target_ongoing_requests"] == 64.0  # type: ignore[index]


def test_the_haproxy_peer_is_attached_only_under_haproxy(monkeypatch: pytest.MonkeyPatch) -> None:
    args = AppArgs(num_replicas=2)
    monkeypatch.setattr(prefix_routing, "haproxy_ingress", lambda: False)
    assert build_app(args)._ingress_request_router is None
    monkeypatch.setattr(prefix_routing, "haproxy_ingress", lambda: True)
    assert build_app(args)._ingress_request_router is not None
    assert build_app(AppArgs(num_replicas=2, prefix_routing=False))._ingress_request_router is None
    assert with_route_ingress(build_app(AppArgs()), AppArgs())._ingress_request_router is None


def test_the_route_app_hands_the_parsed_body_to_the_pick() -> None:
    from fastapi.testclient import TestClient

    from tandem.deploy.routing.ingress_mode import ROUTER_BODY_ENV, ray_environment
    from tandem.deploy.routing.route_ingress import build_route_app, routing_body

    picked: list[Any] = []

    async def pick(body: dict[str, Any] | None) -> dict[str, Any]:
        picked.append(body)
        return {"host": "10.0.0.2", "port": 30001, "replica_id": "LLMServer#abc"}

    client = TestClient(build_route_app(pick))
    answer = client.post("/internal/route", content=b'{"prompt": "shared head", "max_tokens": 4}')
    assert answer.status_code == 200 and answer.json()["replica_id"] == "LLMServer#abc"
    # HAProxy may forward only the head of a long body: not JSON, so routed by load alone.
    client.post("/internal/route", content=b'{"prompt": "cut of', headers={"x-body-truncated": "11/900"})
    assert picked == [{"prompt": "shared head", "max_tokens": 4}, None]
    assert routing_body(b"") is None and routing_body(b"[1, 2]") is None
    assert ray_environment("haproxy")[ROUTER_BODY_ENV] == "1" and ROUTER_BODY_ENV not in ray_environment(
        "proxy"
    )
