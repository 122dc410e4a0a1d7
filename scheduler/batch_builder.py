"""Turns the scheduled rows into plain tensors for the engine.

Host arrays are built with numpy (tiny gathers; torch's intra-op threads would cost milliseconds per
op here), wrapped as (pinned, on CUDA) tensors and copied to the device with non_blocking=True on the
scheduler stream. Input ids and penalty history are gathered from the token pool later, on the engine
stream, so they include tokens the previous batch has only just written there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from tandem.engine.batch import AttentionGroupBatch, SamplingBatch
from tandem.engine.sampler import GREEDY_EPS
from tandem.scheduler.kv_manager import KVManager
from tandem.scheduler.request import Request
from tandem.scheduler.table import RequestTable

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Row:
    req: Request
    start: int  # first position computed this step
    length: int  # tokens computed this step
    samples: bool  # whether this step's token is an output (False mid-prefill)


@dataclass(frozen=True)
class PreparedBatch:
    """Everything but the token-pool gathers, which must run on the engine stream."""

    batch_id: int
    rows: list[Row]
    input_mapping: torch.Tensor  # int64 [T], device: token-pool index of each input token
    output_mapping: torch.Tensor  # int64 [B], device: where each sampled token goes; -1 for none
    positions: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    groups: tuple[AttentionGroupBatch, ...]
    sampling: SamplingBatch
    history_index: torch.Tensor | None  # int64 [B, L] token-pool indices, -1 past each row's length
    is_decode: bool


class BatchBuilder:
    def __init__(self, table: RequestTable, kv: KVManager, device: torch.device) -> None:
        self.table = table
        self.kv = kv
        self.device = device
        self.pin = device.type == "cuda"

    def _host(self, array: npt.NDArray[np.generic]) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.pin_memory() if self.pin else tensor

    def _device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True) if self.pin else host

    def _upload(self, values: list[int] | list[float] | npt.NDArray[np.generic], dtype: type) -> torch.Tensor:
        return self._device(self._host(np.asarray(values, dtype=dtype)))

    def build(self, batch_id: int, rows: list[Row]) -> PreparedBatch:
        max_len = self.table.max_seq_len
        starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=len(rows))
        lengths = np.fromiter((r.length for r in rows), dtype=np.int64, count=len(rows))
        slots = np.fromiter((r.req.slot for r in rows), dtype=np.int64, count=len(rows))
        samples = np.fromiter((r.samples for r in rows), dtype=bool, count=len(rows))
        ends = starts + lengths
        is_decode = bool((lengths == 1).all())
        if is_decode:
            row_of_token, positions = np.arange(len(rows)), starts
        else:
            row_of_token = np.repeat(np.arange(len(rows)), lengths)
            offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            positions = starts[row_of_token] + offsets
        inputs = slots[row_of_token] * max_len + positions
        outputs = np.where(samples & (ends < max_len), slots * max_len + ends, -1)
        seq_cpu = self._host(ends.astype(np.int32))
        ext_cpu = self._host(lengths.astype(np.int32))
        groups = tuple(
            self._group(g, rows, slots, ends, row_of_token, positions) for g in range(len(self.kv.groups))
        )
        return PreparedBatch(
            batch_id=batch_id,
            rows=rows,
            input_mapping=self._upload(inputs, np.int64),
            output_mapping=self._upload(outputs, np.int64),
            positions=self._upload(positions, np.int64),
            seq_lens=self._device(seq_cpu),
            extend_lens=self._device(ext_cpu),
            seq_lens_cpu=seq_cpu,
            extend_lens_cpu=ext_cpu,
            groups=groups,
            sampling=self._sampling(rows),
            history_index=self._history(rows),
            is_decode=is_decode,
        )

    def _group(
        self,
        g: int,
        rows: list[Row],
        slots: IntArray,
        ends: IntArray,
        row_of_token: IntArray,
        positions: IntArray,
    ) -> AttentionGroupBatch:
        ps = self.kv.page_size
        width = int((ends.max() + ps - 1) // ps)
        table = self.table.page_tables[g][slots, :width]
        loc = table[row_of_token, positions // ps].astype(np.int64) * ps + positions % ps
        kv_start = np.fromiter((self.kv.kv_start(r.req, g) for r in rows), dtype=np.int32, count=len(rows))
        table_cpu, start_cpu = self._host(table), self._host(kv_start)
        return AttentionGroupBatch(
            page_table=self._device(table_cpu),
            kv_start=self._device(start_cpu),
            out_cache_loc=self._upload(loc, np.int64),
            kv_start_cpu=start_cpu,
            page_table_cpu=table_cpu,
        )

    def _sampling(self, rows: list[Row]) -> SamplingBatch:
        specs = [r.req.sampling for r in rows]
        logprobs = [s.logprobs for s in specs if s.logprobs is not None]
        return SamplingBatch(
            temperature=self._upload([s.temperature for s in specs], np.float32),
            top_p=self._upload([s.top_p for s in specs], np.float32),
            top_k=self._upload([s.top_k for s in specs], np.int64),
            min_p=self._upload([s.min_p for s in specs], np.float32),
            seeds=self._upload([r.req.seed for r in rows], np.int64),
            steps=self._upload([r.req.scheduled_outputs for r in rows], np.int64),
            presence_penalty=self._upload([s.presence_penalty for s in specs], np.float32),
            frequency_penalty=self._upload([s.frequency_penalty for s in specs], np.float32),
            repetition_penalty=self._upload([s.repetition_penalty for s in specs], np.float32),
            prompt_lens=self._upload([r.req.prompt_len for r in rows], np.int64),
            all_greedy=all(s.temperature == 0.0 for s in specs),
            any_greedy=any(s.temperature < GREEDY_EPS for s in specs),
            any_top_k_top_p=any(s.top_k > 0 or s.top_p < 1.0 for s in specs),
            any_min_p=any(s.min_p > 0.0 for s in specs),
            any_explicit_seed=any(s.seed is not None for s in specs),
            num_logprobs=max(logprobs) if logprobs else -1,
        )

    def _history(self, rows: list[Row]) -> torch.Tensor | None:
        if not any(_has_penalty(r.req) for r in rows):
            return None
        # Tokens known to the pool before this step's sample: the prompt and every earlier output.
        lengths = np.array([r.req.device_len for r in rows], dtype=np.int64)
        cols = np.arange(int(lengths.max()))[None, :]
        base = np.array([r.req.slot * self.table.max_seq_len for r in rows], dtype=np.int64)[:, None]
        return self._upload(np.where(cols < lengths[:, None], base + cols, -1), np.int64)


def _has_penalty(req: Request) -> bool:
    s = req.sampling
    return s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or s.repetition_penalty != 1.0
