"""Turns the scheduled rows into plain tensors for the engine.

Host tensors are built in (pinned, on CUDA) memory and copied to the device with non_blocking=True on
the scheduler stream; input ids and penalty history are gathered from the token pool later, on the
engine stream, so they include tokens the previous batch has only just written there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.batch import AttentionGroupBatch, SamplingBatch
from tandem.scheduler.kv_manager import KVManager
from tandem.scheduler.request import Request
from tandem.scheduler.table import RequestTable


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

    def _to_device(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self.pin)
        return host.to(self.device, non_blocking=True)

    def build(self, batch_id: int, rows: list[Row]) -> PreparedBatch:
        table = self.table
        seq = [r.start + r.length for r in rows]
        ext = [r.length for r in rows]
        positions: list[int] = []
        inputs: list[int] = []
        outputs: list[int] = []
        for r in rows:
            base = r.req.slot * table.max_seq_len
            positions.extend(range(r.start, r.start + r.length))
            inputs.extend(range(base + r.start, base + r.start + r.length))
            end = r.start + r.length
            outputs.append(base + end if r.samples and end < table.max_seq_len else -1)
        pos_cpu = torch.tensor(positions, dtype=torch.int64)
        slots = torch.tensor([r.req.slot for r in rows], dtype=torch.int64)
        groups = tuple(self._group(g, rows, slots, seq, pos_cpu) for g in range(len(self.kv.groups)))
        return PreparedBatch(
            batch_id=batch_id,
            rows=rows,
            input_mapping=self._to_device(inputs, torch.int64),
            output_mapping=self._to_device(outputs, torch.int64),
            positions=pos_cpu.pin_memory().to(self.device, non_blocking=True) if self.pin else pos_cpu,
            seq_lens=self._to_device(seq, torch.int32),
            extend_lens=self._to_device(ext, torch.int32),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
            extend_lens_cpu=torch.tensor(ext, dtype=torch.int32),
            groups=groups,
            sampling=self._sampling(rows),
            history_index=self._history(rows),
            is_decode=all(n == 1 for n in ext),
        )

    def _group(
        self, g: int, rows: list[Row], slots: torch.Tensor, seq: list[int], pos: torch.Tensor
    ) -> AttentionGroupBatch:
        ps = self.kv.page_size
        width = max(-(-n // ps) for n in seq)
        table = self.table.page_tables[g].index_select(0, slots)[:, :width].contiguous()
        row_of_token = torch.repeat_interleave(
            torch.arange(len(rows)), torch.tensor([r.length for r in rows])
        )
        pages = table[row_of_token, pos // ps].to(torch.int64)
        loc = pages * ps + pos % ps
        kv_start = torch.tensor([self.kv.kv_start(r.req, g) for r in rows], dtype=torch.int32)
        if self.pin:
            return AttentionGroupBatch(
                page_table=table.pin_memory().to(self.device, non_blocking=True),
                kv_start=kv_start.pin_memory().to(self.device, non_blocking=True),
                out_cache_loc=loc.pin_memory().to(self.device, non_blocking=True),
                kv_start_cpu=kv_start,
                page_table_cpu=table,
            )
        return AttentionGroupBatch(table, kv_start, loc, kv_start, table)

    def _sampling(self, rows: list[Row]) -> SamplingBatch:
        specs = [r.req.sampling for r in rows]
        logprobs = [s.logprobs for s in specs if s.logprobs is not None]
        return SamplingBatch(
            temperature=self._to_device([s.temperature for s in specs], torch.float32),
            top_p=self._to_device([s.top_p for s in specs], torch.float32),
            top_k=self._to_device([s.top_k for s in specs], torch.int64),
            min_p=self._to_device([s.min_p for s in specs], torch.float32),
            seeds=self._to_device([r.req.seed for r in rows], torch.int64),
            steps=self._to_device([r.req.scheduled_outputs for r in rows], torch.int64),
            presence_penalty=self._to_device([s.presence_penalty for s in specs], torch.float32),
            frequency_penalty=self._to_device([s.frequency_penalty for s in specs], torch.float32),
            repetition_penalty=self._to_device([s.repetition_penalty for s in specs], torch.float32),
            prompt_lens=self._to_device([r.req.prompt_len for r in rows], torch.int64),
            all_greedy=all(s.temperature == 0.0 for s in specs),
            any_top_k_top_p=any(s.top_k > 0 or s.top_p < 1.0 for s in specs),
            any_min_p=any(s.min_p > 0.0 for s in specs),
            any_explicit_seed=any(s.seed is not None for s in specs),
            num_logprobs=max(logprobs) if logprobs else -1,
        )

    def _history(self, rows: list[Row]) -> torch.Tensor | None:
        if not any(_has_penalty(r.req) for r in rows):
            return None
        # Tokens known to the pool before this step's sample: the prompt and every earlier output.
        lengths = [r.req.device_len for r in rows]
        width = max(lengths)
        cols = torch.arange(width).unsqueeze(0)
        base = torch.tensor([r.req.slot * self.table.max_seq_len for r in rows]).unsqueeze(1)
        index = torch.where(cols < torch.tensor(lengths).unsqueeze(1), base + cols, -1)
        return index.pin_memory().to(self.device, non_blocking=True) if self.pin else index


def _has_penalty(req: Request) -> bool:
    s = req.sampling
    return s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or s.repetition_penalty != 1.0
