"""The device metadata flashinfer_backend.py's kernels read: per batch, where new K/V go; per KV group,
the decode graphs' fixed-address buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.attention.paged_layout import DecodeGraphMeta


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
    all graphs replay on one stream, each right after its own plan, so they never overlap).

    The device fields are views of one int32 buffer, `meta`: indptr, last-page lengths and coords back
    to back (the header), then the page indices. A plan writes the same layout into `staging`, a
    persistent host buffer (pinned on CUDA), and sends the header and the indices it lists in one
    copy.
    """

    meta: torch.Tensor  # int32 [header + capacity], device
    staging: torch.Tensor  # int32 [header + capacity], host: the next plan's values
    staged: DecodeGraphMeta  # numpy views of `staging` for the largest graph, where a plan writes
    header: int  # elements of `meta` before the indices, a multiple of 4 (16-byte aligned)
    last_at: int  # where the last-page lengths start in `meta` (indptr starts at 0)
    coords_at: int  # where the coords start
    indptr: torch.Tensor  # int32 [max_bs + 1]; these three are the graph wrappers' own buffers
    indices: torch.Tensor  # int32 [capacity]
    last_page_len: torch.Tensor  # int32 [max_bs]
    rows: torch.Tensor  # int32 [max_bs]: 0, 1, 2, ...: decode rows append one token each
    # int32 [2, max_bs]: row 0 each new token's position in its row's listed KV (the append kernel's),
    # row 1 its flat pool slot (`new_kv_slots`).
    coords: torch.Tensor
    wrappers: dict[int, Any]  # padded batch size -> graph-mode decode wrapper

    def send(self, listed: int) -> None:
        """Start the copy of a plan's staged values: the header and the `listed` page indices after it,
        in one copy. The next plan writes `staging` again only after it ran (the backend's
        `_wait_previous_plan`)."""
        end = self.header + listed
        self.meta[:end].copy_(self.staging[:end], non_blocking=True)

    def append_targets(self, batch_size: int) -> AppendTargets:
        """Where a decode graph of `batch_size` rows stores new K/V: its own buffers, fixed per size."""
        bs = batch_size
        return AppendTargets(
            self.rows[:bs],
            self.coords[0, :bs],
            self.indices,
            self.indptr[: bs + 1],
            self.last_page_len[:bs],
            self.coords[1, :bs],
        )

    @classmethod
    def allocate(
        cls, max_bs: int, capacity: int, dummy_page: int, device: torch.device, wrappers: dict[int, Any]
    ) -> GraphBuffers:
        """Every region starts on a 16-byte boundary. Padding rows list `dummy_page` alone."""
        aligned = [-(-n // 4) * 4 for n in (max_bs + 1, max_bs, 2 * max_bs)]
        header = sum(aligned)
        meta = torch.zeros(header + capacity, dtype=torch.int32, device=device)
        last_at, coords_at = aligned[0], aligned[0] + aligned[1]
        last_page_len = meta[last_at : last_at + max_bs]
        last_page_len.fill_(1)
        indices = meta[header:]
        indices.fill_(dummy_page)
        staging = torch.empty(meta.shape, dtype=torch.int32, pin_memory=device.type == "cuda")
        staging.copy_(meta)  # stale values past a batch's rows stay valid ones, as on the device
        host = staging.numpy()
        staged = DecodeGraphMeta(
            indptr=host[: max_bs + 1],
            last_page_len=host[last_at : last_at + max_bs],
            coords=host[coords_at : coords_at + 2 * max_bs].reshape(2, max_bs),
            indices=host[header:],
        )
        return cls(
            meta=meta,
            staging=staging,
            staged=staged,
            header=header,
            last_at=last_at,
            coords_at=coords_at,
            indptr=meta[: max_bs + 1],
            indices=indices,
            last_page_len=last_page_len,
            rows=torch.arange(max_bs, dtype=torch.int32, device=device),
            coords=meta[coords_at : coords_at + 2 * max_bs].view(2, max_bs),
            wrappers=wrappers,
        )
