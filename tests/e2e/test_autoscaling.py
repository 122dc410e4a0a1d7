"""Serve autoscaling of LLMServer replicas: 1 -> 2 under load, back to 1 when it drops, and no request lost
on the way (the replica that goes drains its in-flight requests before it stops)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

SCALE_TIMEOUT_S = 120.0


def _running_replicas(app_name: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app_name].deployments["LLMServer"]
    return int(deployment.replica_states.get("RUNNING", 0))


async def _until_replicas(app_name: str, wanted: int, seen: list[int]) -> None:
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while time.monotonic() < deadline:
        count = await asyncio.to_thread(_running_replicas, app_name)
        seen.append(count)
        if count == wanted:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"never {wanted} running replicas; saw {seen[-20:]}")


def test_scale_up_under_load_and_back_down_loses_no_request(
    serve_app_context: Any, tiny_model_dir: Any, openai_call: Any, open_session: Any
) -> None:
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-autoscale",
        "device": "cpu",
        "max_ongoing_requests": 8,
        # Short delays and windows, so the test takes seconds rather than Serve's minutes.
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 1,
            "downscale_delay_s": 2,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
        },
    }
    body = {
        "model": "tiny-autoscale",
        "prompt": "The autoscaler watches the ongoing requests of each replica",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    outcomes: list[Any] = []
    seen: list[int] = []

    async def run(app: Any) -> None:
        async with open_session(app.base_url, connections=16) as session:

            async def worker(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    outcomes.append(await openai_call(session, "/v1/completions", body))

            heavy, light = asyncio.Event(), asyncio.Event()
            # 8 at a time: 4x the target of 2 per replica, so Serve wants the maximum of 2 replicas.
            workers = [asyncio.create_task(worker(heavy)) for _ in range(6)]
            workers += [asyncio.create_task(worker(light)) for _ in range(2)]
            try:
                await _until_replicas(app.name, 2, seen)
                heavy.set()  # 2 at a time: one replica's target, so Serve removes one, under traffic
                await _until_replicas(app.name, 1, seen)
                await asyncio.sleep(1.0)  # requests keep flowing to the one replica left
            finally:
                heavy.set()
                light.set()
                await asyncio.gather(*workers)

    with serve_app_context(args, name="tandem-autoscale") as app:
        assert _running_replicas(app.name) == 1
        asyncio.run(run(app))
    problems = [(o.status, o.error, o.problem) for o in outcomes if not o.complete]
    assert not problems, problems[:5]
    assert len(outcomes) >= 16 and 2 in seen and seen[-1] == 1
