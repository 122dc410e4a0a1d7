"""How many requests one replica runs at once: what admission, autoscaling and routing scale by."""

from __future__ import annotations

from tandem.deploy.config.args import AppArgs
from tandem.engine.options import EngineOptions
from tandem.scheduler.runtime import MAX_RUNNING_CPU, MAX_RUNNING_GPU


def engine_capacity_bound(args: AppArgs, device: str) -> int:
    """The most requests a replica's engine can run at once, known before it starts: its max_running
    setting, else the largest decode graph on GPU. A small KV pool may lower it once the engine is up
    (the replica then admits what the engine reports)."""
    engine = args.engine
    if engine.max_running is not None:
        return int(engine.max_running)
    if device != "cuda":
        return MAX_RUNNING_CPU
    if engine.cuda_graph is False:
        return MAX_RUNNING_GPU
    graph_max = int(engine.cuda_graph_max_bs or EngineOptions().cuda_graph_max_bs)
    return min(MAX_RUNNING_GPU, graph_max)


def replica_capacity(args: AppArgs, device: str) -> int:
    """`max_ongoing_requests` when set, else what the engine can run at once."""
    return args.max_ongoing_requests or engine_capacity_bound(args, device)
