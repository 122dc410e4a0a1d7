"""The replica <-> rank-0 channel over loopback zmq: what rank 0's per-step receive returns, and that
outputs arrive whole and in order."""

from __future__ import annotations

import asyncio
import time

from tandem.replicas.channel import RankChannel, ReplicaChannel
from tandem.scheduler.messages import AbortRequest, AddRequest, SamplingSpec, TokenOutput


def test_rank_receives_everything_queued_in_order_and_nothing_when_idle() -> None:
    async def run() -> tuple[list[object], list[object], list[object], list[TokenOutput]]:
        replica = ReplicaChannel("127.0.0.1")
        rank = RankChannel(replica.address)
        try:
            idle = rank.recv_all(0)  # every step asks; nothing is queued yet
            sent: list[object] = [
                AddRequest(1, [5, 6, 7], SamplingSpec(max_tokens=4)),
                AbortRequest(0),
                AddRequest(2, [8], SamplingSpec(max_tokens=1, temperature=0.0)),
            ]
            for msg in sent:
                await replica.send(msg)  # type: ignore[arg-type]
            got: list[object] = []
            deadline = time.monotonic() + 5
            while len(got) < len(sent) and time.monotonic() < deadline:
                got += rank.recv_all(50)  # the first wait blocks until the connection delivers
            outputs = [TokenOutput(1, 9, None), TokenOutput(2, 3, "length", cached_tokens=0)]
            rank.send(outputs)
            received = await asyncio.wait_for(replica.recv(), 5)
            return idle, sent, got, received
        finally:
            rank.close()
            replica.close()

    idle, sent, got, received = asyncio.run(run())
    assert idle == []
    assert got == sent
    assert received == [TokenOutput(1, 9, None), TokenOutput(2, 3, "length", cached_tokens=0)]
