"""Which adapter slot each token of a batch reads, as the LoRA kernels take it, in fixed device buffers.

The scheduler hands the engine each row's slot (-1: the base model). From it and the rows' token counts
the engine works out, with numpy on the host, three int32 arrays and sends them in one copy:

- `token_slots` [T]: every token's slot (the torch reference path reads this);
- `sorted_tokens` [T]: the tokens that have a slot, grouped by slot (stable within a slot);
- `tiles`: a count, then (slot, start, end, 0) per tile: up to `TILE` consecutive entries of
  `sorted_tokens` that share a slot. A kernel program takes one tile, so every row of its block reads
  the same A and B.

A batch of T tokens never needs more than `max_tiles(T)` tiles, so a kernel's grid depends on T alone,
and a CUDA graph captured for T reads whatever tiles the last plan wrote (programs past the count do
nothing). The buffers are written in place, never reallocated, so captured graphs keep reading them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

TILE = 16  # tokens per kernel program: the smallest tensor-core block
_HEADER = 4  # int32s before the tile entries: the count, then padding to 16 bytes


def max_tiles(tokens: int, slots: int) -> int:
    """Most tiles `tokens` tokens over `slots` slots can take: the sum of ceil(n / TILE) over the slots'
    counts n, at most (tokens + (TILE - 1) x the slots in use) / TILE."""
    return (tokens + (TILE - 1) * min(slots, tokens)) // TILE


def plan_tiles(
    row_slots: npt.NDArray[np.int32], extend_lens: npt.NDArray[np.int32]
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """(token_slots [T], sorted_tokens [n], tiles [k, 4]) for rows with these slots and token counts."""
    token_slots = np.repeat(row_slots.astype(np.int32), extend_lens)
    has = np.flatnonzero(token_slots >= 0)
    order = has[np.argsort(token_slots[has], kind="stable")].astype(np.int32)
    slots_sorted = token_slots[order]
    if not len(order):
        return token_slots, order, np.zeros((0, 4), dtype=np.int32)
    # Run boundaries of equal slots, then each run cut into TILE-token pieces.
    edges = np.flatnonzero(np.diff(slots_sorted)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [len(order)]))
    pieces = -(-(ends - starts) // TILE)
    run = np.repeat(np.arange(len(starts)), pieces)
    within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    tile_start = starts[run] + within * TILE
    tiles = np.zeros((len(run), 4), dtype=np.int32)
    tiles[:, 0] = slots_sorted[starts[run]]
    tiles[:, 1] = tile_start
    tiles[:, 2] = np.minimum(tile_start + TILE, ends[run])
    return token_slots, order, tiles


class LoraBatchBuffers:
    """The three arrays for batches of up to `capacity` tokens, as views of one device buffer.

    On CUDA a plan is written into one of a few pinned host buffers, taken in turn (each written again only
    once the copy that last read it has run), and sent in one copy on the current stream; on CPU it is
    written straight into the arrays.
    """

    def __init__(self, capacity: int, slots: int, device: torch.device, staging: int = 3) -> None:
        self.capacity = capacity
        self.slots = slots
        self.device = device
        self._tiles_at = 2 * _aligned4(capacity)
        numel = self._tiles_at + _HEADER + 4 * max_tiles(capacity, slots)
        self.buffer = torch.zeros(numel, dtype=torch.int32, device=device)
        self.token_slots = self.buffer[:capacity]
        self.sorted_tokens = self.buffer[_aligned4(capacity) : _aligned4(capacity) + capacity]
        self.tiles = self.buffer[self._tiles_at :]
        self._cuda = device.type == "cuda"
        self._hosts: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = []
        if self._cuda:
            self._hosts = [torch.zeros(numel, dtype=torch.int32, pin_memory=True) for _ in range(staging)]
            self._copied = [None] * staging
        self._next = 0

    def write(self, row_slots: npt.NDArray[np.int32], extend_lens: npt.NDArray[np.int32]) -> None:
        """Plan a batch of these rows into the buffers (its tokens must fit `capacity`)."""
        token_slots, order, tiles = plan_tiles(row_slots, extend_lens)
        tokens = len(token_slots)
        if tokens > self.capacity:
            raise ValueError(f"a batch of {tokens} tokens is over the LoRA buffers' {self.capacity}")
        if not self._cuda:
            self._fill(self.buffer.numpy(), token_slots, order, tiles)
            return
        i = self._next
        self._next = (i + 1) % len(self._hosts)
        event = self._copied[i]
        if event is not None:
            event.synchronize()
        host = self._hosts[i]
        end = self._fill(host.numpy(), token_slots, order, tiles)
        self.buffer[:end].copy_(host[:end], non_blocking=True)
        if event is None:
            event = self._copied[i] = torch.cuda.Event()
        event.record()

    def _fill(
        self,
        raw: npt.NDArray[np.int32],
        token_slots: npt.NDArray[np.int32],
        order: npt.NDArray[np.int32],
        tiles: npt.NDArray[np.int32],
    ) -> int:
        """Write the arrays into `raw` (the buffer's layout); return how many int32s a copy must send."""
        raw[: len(token_slots)] = token_slots
        # No slot for the rows past the batch (a graph's padding), which a GEMV's folded delta reads; the
        # copy sends these words anyway, being below the tiles.
        raw[len(token_slots) : self.capacity] = -1
        start = _aligned4(self.capacity)
        raw[start : start + len(order)] = order
        at = self._tiles_at
        raw[at] = len(tiles)
        raw[at + _HEADER : at + _HEADER + tiles.size] = tiles.reshape(-1)
        return at + _HEADER + tiles.size


def _aligned4(n: int) -> int:
    return -(-n // 4) * 4
