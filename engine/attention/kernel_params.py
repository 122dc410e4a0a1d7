"""Per-KV-group kernel parameters, in the conventions paged-attention kernels (flashinfer) expect."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.attention.base import LayerSpec
from tandem.engine.kv_pool import KVGroupSpec


@dataclass(frozen=True)
class GroupKernel:
    """What every layer of one KV group shares, so one plan serves all of them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # flashinfer's window is inclusive on the left: keys in [q - window_left, q]. Ours shows keys in
    # (q - window, q], so window_left = window - 1; -1 turns the window off.
    window_left: int
    softcap: float  # 0 turns soft-capping off
    sinks: bool = False  # the layers have sink logits (attention/sinks.py): the kernel returns its lse

    @property
    def one_launch(self) -> bool:
        """Whether the one-launch Triton decode (triton_decode.py) can run this group's layers: full
        attention, no soft-cap, no sinks (it has none: gpt-oss's layers take flashinfer's decode and the
        sink epilogue), a power-of-two head_dim."""
        return (
            self.window_left == -1
            and self.softcap == 0.0
            and not self.sinks
            and self.head_dim & (self.head_dim - 1) == 0
        )

    @classmethod
    def of(cls, specs: Sequence[LayerSpec]) -> GroupKernel:
        if not specs:
            raise ValueError("a KV group needs at least one layer")
        kernels = {
            cls(
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                s.scale,
                -1 if s.window is None else s.window - 1,
                0.0 if s.softcap is None else s.softcap,
                s.sinks,
            )
            for s in specs
        }
        if len(kernels) != 1:
            raise ValueError(
                f"layers of one KV group disagree on attention parameters: {sorted(map(str, kernels))}"
            )
        return kernels.pop()


def group_kernels(groups: Sequence[KVGroupSpec], layers: Sequence[LayerSpec]) -> dict[int, GroupKernel]:
    """GroupKernel per group id; checks each group's window against its layers'."""
    by_id = {s.layer_id: s for s in layers}
    missing = [i for g in groups for i in g.layers if i not in by_id]
    if missing:
        raise ValueError(f"no LayerSpec for layers {missing}")
    kernels: dict[int, GroupKernel] = {}
    for g in groups:
        kernel = GroupKernel.of([by_id[i] for i in g.layers])
        expected = -1 if g.window is None else g.window - 1
        if kernel.window_left != expected:
            raise ValueError(
                f"KV group {g.group_id} has window {g.window}, its layers window_left {kernel.window_left}"
            )
        kernels[g.group_id] = kernel
    return kernels
