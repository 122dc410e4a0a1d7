"""Mixture-of-experts models at tp_size=2 over gloo, in a pair of spawned processes: each rank runs every
job's prompts to completion (greedy) with tensor parallelism and again with expert parallelism, and
reports its tokens and the expert shapes it held. The MoE families' tests share it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.distributed import TPGroup
from tandem.engine.moe.experts import MoEExperts
from tandem.scheduler.messages import AddRequest, SamplingSpec, SchedulerMsg, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

from .rank_runs import run_until_idle

CHUNK = 16  # prefill chunk: the tests' longest prompts prefill in several
MAX_NEW = 16

# name -> (model dir, prompts)
Jobs = dict[str, tuple[str, list[list[int]]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(model_dir: str, rank: int, prompts: list[list[int]], ep: bool) -> dict[str, Any]:
    options = RuntimeOptions.of(device="cpu", chunk_size=CHUNK, enable_expert_parallel=ep)
    tp = TPGroup(rank, 2, dist.group.WORLD)
    outputs: list[TokenOutput] = []
    runtime = RankRuntime(Path(model_dir), options, tp, outputs.extend)
    held = [tuple(m.w13.shape) for m in runtime.engine.model.modules() if isinstance(m, MoEExperts)]
    spec = SamplingSpec(max_tokens=MAX_NEW, temperature=0.0)
    messages: list[SchedulerMsg] = [AddRequest(i, p, spec) for i, p in enumerate(prompts)]
    done = run_until_idle(runtime, outputs, messages)
    tokens = [done.get(i, []) for i in range(len(prompts))]
    return {"tokens": tokens, "experts_held": held}


def _worker(rank: int, port: int, jobs: Jobs, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, (model_dir, prompts) in jobs.items():
        for mode in ("tp", "ep"):
            results[f"{name}/{mode}"] = _rank(model_dir, rank, prompts, ep=mode == "ep")
    dist.destroy_process_group()
    queue.put((rank, results))


def moe_two_ranks(jobs: Jobs) -> dict[int, dict[str, dict[str, Any]]]:
    """rank -> "<job>/tp" | "<job>/ep" -> {"tokens": per prompt, "experts_held": [w13 shapes]}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, jobs, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results
