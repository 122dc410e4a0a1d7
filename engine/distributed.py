"""The tensor-parallel group one rank belongs to, passed down explicitly (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its TP group. At size 1 every collective is the identity, with no group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank {self.rank} of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TP group of size > 1 needs a torch.distributed process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension, in rank order (into `out`, if given)."""
        if self.size == 1:
            return x if out is None else out.copy_(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1, out=out)

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total`; `total` must divide evenly."""
        if total % self.size:
            raise ValueError(f"dimension {total} does not divide evenly over tp_size={self.size}")
        part = total // self.size
        return self.rank * part, part
