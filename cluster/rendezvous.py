"""torch.distributed rendezvous for one TP group: rank 0 picks a free port on its node."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from tandem.engine.distributed import TPGroup


def node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankGroups:
    """The data-plane group (NCCL on GPU, gloo on CPU) and a gloo group for control messages."""

    tp: TPGroup
    control: dist.ProcessGroup | None


def join(
    rank: int, size: int, address: str, port: int, *, use_gpu: bool, timeout_s: float = 120.0
) -> RankGroups:
    if size == 1 and not use_gpu:
        return RankGroups(TPGroup(), None)
    # On GPU even a single rank joins an NCCL group, so TP=1 and TP>1 share one init path.
    backend = "nccl" if use_gpu else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    world = dist.group.WORLD
    assert world is not None
    control = dist.new_group(backend="gloo") if use_gpu else world
    return RankGroups(TPGroup(rank, size, world if size > 1 else None), control)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
