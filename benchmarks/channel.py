"""Replica <-> rank-0 data channel: the latency it adds per step (budget: <= 1 ms at p50).

Rank 0 runs in a separate process, as it does under Ray. The replica sends an AddRequest and rank 0
answers with one step's worth of TokenOutputs (`--batch` rows); the round trip, halved, is the
latency the channel adds in each direction.

    python benchmarks/channel.py --iters 5000 --batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import time
from pathlib import Path

from tandem.replicas.channel import ChannelAddress, RankChannel, ReplicaChannel
from tandem.scheduler.messages import AddRequest, SamplingSpec, TokenOutput


def rank0(address: ChannelAddress, iters: int, batch: int) -> None:
    channel = RankChannel(address)
    outputs = [TokenOutput(rid=i, token_id=1000 + i, finish_reason=None) for i in range(batch)]
    for _ in range(iters):
        while not channel.recv_all(timeout_ms=1000):
            pass
        channel.send(outputs)
    channel.close()


async def replica(channel: ReplicaChannel, iters: int) -> list[float]:
    msg = AddRequest(rid=1, prompt_ids=list(range(128)), sampling=SamplingSpec(max_tokens=16))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        await channel.send(msg)
        await channel.recv()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "channel.json")
    args = parser.parse_args()
    channel = ReplicaChannel("127.0.0.1")
    proc = mp.get_context("spawn").Process(target=rank0, args=(channel.address, args.iters, args.batch))
    proc.start()
    times = asyncio.run(replica(channel, args.iters))
    proc.join()
    channel.close()
    warm = sorted(times[len(times) // 10 :])
    pct = {p: warm[int(len(warm) * p / 100) - 1] * 1e3 for p in (50, 90, 99)}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "benchmark": "channel_round_trip",
        "device": f"CPU only ({platform.processor() or platform.machine()}, {mp.cpu_count()} cores)",
        "commit": commit,
        "config": {"iters": args.iters, "batch_rows": args.batch, "transport": "zmq tcp loopback + msgpack"},
        "round_trip_ms": {f"p{p}": round(v, 4) for p, v in pct.items()},
        "one_way_ms_p50": round(pct[50] / 2, 4),
        "mean_ms": round(statistics.fmean(warm) * 1e3, 4),
        "budget_ms_p50": 1.0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
