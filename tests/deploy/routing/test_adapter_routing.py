"""LoRA adapter affinity in the request router (routing/adapter_affinity.py, through PrefixAffinityRouter)
over fake replicas: an adapter's requests stick to one replica from its first request on (before any
replica reports holding it), two routers place a new adapter alike and spread many adapters, a replica
that reports holding an adapter gets its requests, a full holder is passed over (another replica loads
it), the adapter comes from the body's `model` or Serve's multiplexed model id, and an adapter's prompt
prefixes are its own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from tandem.deploy.routing.prefix_router import PrefixAffinityRouter

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="tandem")
BASE = "base-model"


class FakeReplica:
    def __init__(self, name: str, ongoing: int = 0, held: set[str] | None = None) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats: dict[str, Any] = {"ongoing": ongoing}
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = held or set()
        self.max_ongoing_requests = 1000

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(3600)
        return 0


async def _router(replicas: list[FakeReplica], **kwargs: Any) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(served_model_name=BASE, **kwargs)
    router.update_replicas(replicas)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    return router


async def _route(
    router: PrefixAffinityRouter, replicas: list[FakeReplica], body: Any, model_id: str = ""
) -> str:
    request = PendingRequest(
        args=[body] if body is not None else [],
        kwargs={},
        metadata=SimpleNamespace(multiplexed_model_id=model_id),
    )  # type: ignore[arg-type]
    ranks = await router.choose_replicas(replicas, request)  # type: ignore[arg-type]
    return str(ranks[0][0].replica_id.unique_id)


def test_four_adapters_each_stick_to_one_of_two_replicas() -> None:
    async def run() -> dict[str, set[str]]:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router = await _router(replicas)
        seen: dict[str, set[str]] = {}
        for i in range(40):
            adapter = f"lora{i % 4}"
            model = adapter if i % 2 else f"{BASE}:{adapter}"
            where = await _route(router, replicas, {"model": model, "prompt": f"question {i} " * 5})
            seen.setdefault(adapter, set()).add(where)
        return seen

    seen = asyncio.run(run())
    assert all(len(where) == 1 for where in seen.values()), seen


def test_routers_that_share_nothing_place_each_new_adapter_on_the_same_replica() -> None:
    """HAProxy's route hook and a handle are two routers, each with only its own placements until the
    replicas' reports arrive: both send a new adapter to the same replica, and many adapters spread."""
    names = ["a", "b", "c", "d"]
    adapters = [f"tenant-{i}" for i in range(64)]

    async def placements(order: list[str]) -> dict[str, str]:
        replicas = [FakeReplica(n) for n in names]  # another process's view of the same replicas
        router = await _router(replicas)
        return {a: await _route(router, replicas, {"model": a, "prompt": f"hi from {a}"}) for a in order}

    first = asyncio.run(placements(adapters))
    second = asyncio.run(placements(adapters[::-1]))
    assert first == second
    counts = [list(first.values()).count(n) for n in names]
    assert all(8 <= c <= 24 for c in counts), counts  # 16 each on average


def test_reported_holders_get_the_adapter_and_full_ones_are_passed_over() -> None:
    async def run() -> tuple[str, str, str]:
        replicas = [FakeReplica("a"), FakeReplica("b", held={"sql"})]
        router = await _router(replicas, imbalanced_threshold=4)
        held = await _route(router, replicas, {"model": "sql", "prompt": "hi"})
        replicas[1].routing_stats = {"ongoing": 4}  # at the threshold: still the holder
        still = await _route(router, replicas, {"model": "sql", "prompt": "hello"})
        replicas[1].routing_stats = {"ongoing": 5}  # full: another replica loads it
        moved = await _route(router, replicas, {"model": "sql", "prompt": "hey"})
        return held, still, moved

    held, still, moved = asyncio.run(run())
    assert held == "b" and still == "b" and moved == "a"


def test_an_adapter_request_gets_no_fallback_rank() -> None:
    """Serve tries a later rank when its probe of the first misses the deadline (a busy host), and that
    replica would load the adapter too. An adapter's request gets the pick alone (Serve backs off and asks
    again); a base model's request keeps the others as a fallback."""

    async def run() -> tuple[list[list[str]], list[list[str]]]:
        replicas = [FakeReplica("a", held={"sql"}), FakeReplica("b"), FakeReplica("c")]
        router = await _router(replicas)

        async def ranks(body: dict[str, str]) -> list[list[str]]:
            request = PendingRequest(
                args=[body], kwargs={}, metadata=SimpleNamespace(multiplexed_model_id="")
            )  # type: ignore[arg-type]
            chosen = await router.choose_replicas(replicas, request)  # type: ignore[arg-type]
            return [[str(r.replica_id.unique_id) for r in rank] for rank in chosen]

        return await ranks({"model": "sql", "prompt": "hi"}), await ranks({"model": BASE, "prompt": "hi"})

    adapter, base = asyncio.run(run())
    assert adapter == [["a"]]
    assert len(base) == 2 and sorted(base[0] + base[1]) == ["a", "b", "c"]


def test_the_adapter_comes_from_the_multiplexed_model_id_without_a_body() -> None:
    """Serve's Python proxy hands the router no HTTP body: the `serve_multiplexed_model_id` header (or the
    handle's `multiplexed_model_id` option) still routes by adapter."""

    async def run() -> set[str]:
        replicas = [FakeReplica("a", held={"chat"}), FakeReplica("b")]
        router = await _router(replicas)
        return {await _route(router, replicas, None, model_id="chat") for _ in range(8)}

    assert asyncio.run(run()) == {"a"}


def test_an_adapters_prefixes_are_its_own() -> None:
    """Both replicas hold the adapter; the base model cached a long prompt on one of them. The same prompt
    for the adapter is no cache hit there (its KV differs): it is a new prefix of the adapter's, placed
    on the replica given fewer new prefixes, the other one."""

    async def run() -> tuple[str, str]:
        replicas = [FakeReplica("a", held={"sql"}), FakeReplica("b", held={"sql"})]
        router = await _router(replicas)
        prompt = "shared system prompt " * 30
        base = [await _route(router, replicas, {"model": BASE, "prompt": prompt + str(i)}) for i in range(3)]
        assert len(set(base)) == 1
        return base[0], await _route(router, replicas, {"model": "sql", "prompt": prompt + "0"})

    base, adapter = asyncio.run(run())
    assert adapter != base
