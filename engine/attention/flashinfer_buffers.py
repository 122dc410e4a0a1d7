"""The device metadata flashinfer_backend.py's kernels read: per batch, where new K/V go; per KV group,
the decode graphs' fixed-address buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AppendTargets:
    """Where one batch's new K/V go in one KV group, as flashinfer's append kernel takes it (device
    int32). Positions count from the row's first listed page, so evicted pages are never addressed."""

    rows: torch.Tensor  # [T]: the row of each new token
    positions: torch.Tensor  # [T]: its position in the row's listed KV
    indices: torch.Tensor  # the rows' listed pages, concatenated
    indptr: torch.Tensor  # [B + 1]
    last_page_len: torch.Tensor  # [B]
    slots: torch.Tensor  # [T]: each new token's flat pool slot, for a q/k/v step that stores K/V itself


@dataclass
class GraphBuffers:
    """Fixed-address metadata of one KV group for every decode graph (shared across batch sizes:
    all graphs replay on one stream, each right after its own plan, so they never overlap)."""

    indptr: torch.Tensor  # int32 [max_bs + 1]; these three are the graph wrappers' own buffers
    indices: torch.Tensor  # int32 [capacity]
    last_page_len: torch.Tensor  # int32 [max_bs]
    rows: torch.Tensor  # int32 [max_bs]: 0, 1, 2, ...: decode rows append one token each
    # int32 [2, max_bs], rewritten by each plan in one copy: row 0 each new token's position in its
    # row's listed KV (the append kernel's), row 1 its flat pool slot (`new_kv_slots`).
    coords: torch.Tensor
    wrappers: dict[int, Any]  # padded batch size -> graph-mode decode wrapper
