"""The rank watchdog's verdicts, and the replica's supervision of its receive loop (no Ray needed)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from tandem.replicas.llm_replica import LLMReplica
from tandem.replicas.watchdog import Beat, Problem, RankWatchdog, ReplicaUnhealthy


def test_a_busy_rank_is_stuck_after_the_timeout_and_an_idle_one_much_later() -> None:
    watchdog = RankWatchdog(stuck_after_s=10.0, idle_after_s=60.0)
    assert watchdog.judge(0, Beat(0.05, None, busy=True)) is None
    assert watchdog.judge(0, Beat(9.0, None, busy=True)) is None
    stuck = watchdog.judge(1, Beat(10.5, None, busy=True))
    assert stuck is not None and stuck.code == "rank_stuck" and "rank 1" in stuck.detail
    assert watchdog.judge(0, Beat(30.0, None, busy=False)) is None  # waiting for its peers' next step
    idle = watchdog.judge(0, Beat(61.0, None, busy=False))
    assert idle is not None and idle.code == "rank_stuck"


def test_crashed_and_unreachable_ranks() -> None:
    watchdog = RankWatchdog(stuck_after_s=10.0)
    crashed = watchdog.judge(0, Beat(0.1, "Traceback ...\nRuntimeError: CUDA error\n", busy=True))
    assert crashed == Problem("rank_crashed", "rank 0's loop crashed: RuntimeError: CUDA error")
    unreachable = watchdog.judge(1, TimeoutError())
    assert unreachable is not None and unreachable.code == "rank_unreachable"
    with pytest.raises(ValueError):
        RankWatchdog(stuck_after_s=0)


def test_replica_unhealthy_keeps_its_code_across_pickling() -> None:
    error = ReplicaUnhealthy([Problem("rank_stuck", "rank 1 has work"), Problem("rank_unreachable", "x")])
    copy = pickle.loads(pickle.dumps(error))
    assert copy.code == "rank_stuck" and str(copy) == "rank 1 has work; x"


def test_a_dead_receive_loop_fails_health_at_once() -> None:
    async def scenario() -> ReplicaUnhealthy:
        replica = LLMReplica(None, device="cpu")
        replica._group = object()  # type: ignore[assignment]  # "running", without starting ranks

        async def receive_loop() -> None:
            raise ConnectionError("socket closed")

        task = asyncio.create_task(receive_loop(), name="receive_loop")
        task.add_done_callback(replica._task_ended)
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback runs on the next loop turn
        with pytest.raises(ReplicaUnhealthy) as info:
            await replica.check_health()
        return info.value

    error = asyncio.run(scenario())
    assert error.code == "receive_loop_died" and "ConnectionError: socket closed" in str(error)


def test_a_cancelled_loop_at_shutdown_is_not_a_failure() -> None:
    async def scenario() -> list[Problem]:
        replica = LLMReplica(None, device="cpu")
        replica._group = object()  # type: ignore[assignment]
        task = asyncio.create_task(asyncio.sleep(3600), name="receive_loop")
        task.add_done_callback(replica._task_ended)  # type: ignore[arg-type]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        return replica._problems

    assert asyncio.run(scenario()) == []


def test_a_client_gets_the_reason_code_and_its_request_id_not_the_internals() -> None:
    from tandem.replicas.watchdog import client_reason

    crash = (
        "Traceback ...\nRuntimeError: [../third_party/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:33935\n"
    )
    problem = RankWatchdog(stuck_after_s=10.0).judge(0, Beat(0.1, crash, busy=True))
    assert problem is not None and "127.0.0.1" in problem.detail  # the log keeps the details
    told = client_reason([problem], "cmpl-42")
    assert "rank_crashed" in told and "cmpl-42" in told
    assert not any(detail in told for detail in ("127.0.0.1", "33935", "pair.cc", "gloo"))
