"""Turns the scheduled rows into plain tensors for the engine.

Host arrays are built with numpy (tiny gathers; torch's intra-op threads would cost milliseconds per
op here), packed into one (pinned, on CUDA) buffer and copied to the device in one non_blocking copy on
the scheduler stream (staging.py). Input ids and penalty history are gathered from the token pool
later, on the engine stream, so they include tokens the previous batch has only just written there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from tandem.engine.batch import AttentionGroupBatch, PromptLogprobBatch, SamplingBatch
from tandem.engine.sampler import GREEDY_EPS
from tandem.scheduler.kv_manager import KVManager
from tandem.scheduler.request import Request
from tandem.scheduler.slot_params import FLOAT_PARAMS, INT_PARAMS, SlotParams
from tandem.scheduler.spec.draft_model import build_draft_steps, stage_draft_steps
from tandem.scheduler.spec.staging import SpecPrepared, stage_spec
from tandem.scheduler.staging import PinnedSlots, Staged, Staging
from tandem.scheduler.table import RequestTable

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Row:
    req: Request
    start: int  # first position computed this step
    length: int  # tokens computed this step
    samples: bool  # whether this step's token is an output (False mid-prefill)
    drafts: tuple[int, ...] = ()  # speculative tokens, the row's last `len(drafts)` inputs, to verify


@dataclass(frozen=True)
class PreparedBatch:
    """Everything but the token-pool gathers, which must run on the engine stream."""

    batch_id: int
    rows: list[Row]
    input_mapping: torch.Tensor  # int64 [T], device: token-pool index of each input token
    output_mapping: torch.Tensor  # int64 [B], device: where each sampled token goes; the spare for none
    positions: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    groups: tuple[AttentionGroupBatch, ...]
    sampling: SamplingBatch
    history_index: torch.Tensor | None  # int64 [B, L] token-pool indices, -1 past each row's length
    is_decode: bool
    lora_slots_cpu: torch.Tensor | None = None  # int32 [B]: each row's adapter slot; None: no adapters
    # Prompt positions whose log-probs rows asked for, and (row, positions) in the order they are listed.
    prompt_logprobs: PromptLogprobBatch | None = None
    prompt_rows: tuple[tuple[int, int], ...] = ()
    spec: SpecPrepared | None = None  # the rows' drafts (spec/staging.py); None: no row has any


class BatchBuilder:
    def __init__(
        self,
        table: RequestTable,
        kv: KVManager,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        *,
        lora: bool = False,
        draft_lag: int | None = None,
    ) -> None:
        self.table = table
        self.lora = lora  # whether rows may carry a LoRA slot (the engine has LoRA on)
        # A drafter writes the drafts on the device: stage its steps, which run `draft_lag` positions
        # behind their input tokens (spec/draft_model.py). None: drafts are staged from the host.
        self.draft_lag = draft_lag
        self.kv = kv
        self.device = device
        # Written when a request takes its slot (`admit`), gathered per batch.
        self.params = SlotParams(table.max_running, eos_token_ids)
        self._pinned = PinnedSlots() if device.type == "cuda" else None

    def admit(self, req: Request) -> None:
        """Record a request that has just taken its slot."""
        self.params.set(req.slot, req.sampling, req.seed, req.prompt_len)

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
        stage = Staging(self.device, self._pinned)
        inputs = stage.add(slots[row_of_token] * max_len + positions, np.int64)
        spare = self.table.spare
        outputs = stage.add(np.where(samples & (ends < max_len), slots * max_len + ends, spare), np.int64)
        pos = stage.add(positions, np.int64)
        seq = stage.add(ends, np.int32)
        ext = stage.add(lengths, np.int32)
        groups = [
            self._stage_group(stage, g, rows, slots, ends, row_of_token, positions)
            for g in range(len(self.kv.groups))
        ]
        device_lens = np.fromiter((r.req.device_len for r in rows), dtype=np.int64, count=len(rows))
        sample_slots, sample_lens, spec, steps = slots, device_lens, None, None
        if any(r.drafts for r in rows):  # one sample row per scored position (spec/staging.py)
            spec = stage_spec(stage, rows, slots, lengths, device_lens, max_len)
            sample_slots, sample_lens = spec.sample_slots, spec.sample_lens
            if self.draft_lag is not None:
                steps = stage_draft_steps(stage, rows, self.table, self.kv.page_size, self.draft_lag)
        sampling = self._stage_sampling(stage, sample_slots, sample_lens)
        history = self._stage_history(stage, sample_slots, sample_lens)
        lora = (
            np.fromiter((r.req.lora_slot for r in rows), dtype=np.int32, count=len(rows))
            if self.lora
            else None
        )
        prompt = self._stage_prompt_logprobs(stage, rows, slots, starts, lengths)
        sent = stage.send()
        dev, host = sent.device, sent.host
        return PreparedBatch(
            batch_id=batch_id,
            rows=rows,
            input_mapping=dev(inputs),
            output_mapping=dev(outputs),
            positions=dev(pos),
            seq_lens=dev(seq),
            extend_lens=dev(ext),
            seq_lens_cpu=host(seq),
            extend_lens_cpu=host(ext),
            groups=tuple(
                AttentionGroupBatch(
                    page_table=dev(table),
                    kv_start=dev(start),
                    out_cache_loc=dev(loc),
                    kv_start_cpu=host(start),
                    page_table_cpu=host(table),
                )
                for table, start, loc in groups
            ),
            sampling=sampling.build(sent),
            history_index=None if history is None else dev(history),
            is_decode=is_decode,
            lora_slots_cpu=torch.from_numpy(lora) if lora is not None and (lora >= 0).any() else None,
            prompt_logprobs=None
            if prompt is None
            else PromptLogprobBatch(dev(prompt.index), dev(prompt.targets), prompt.num_top),
            prompt_rows=() if prompt is None else prompt.rows,
            spec=None
            if spec is None
            else spec.build(sent, None if steps is None else build_draft_steps(sent, steps, self.device)),
        )

    def _stage_group(
        self,
        stage: Staging,
        g: int,
        rows: list[Row],
        slots: IntArray,
        ends: IntArray,
        row_of_token: IntArray,
        positions: IntArray,
    ) -> tuple[int, int, int]:
        """Page table rows, kv_start and write slots of one KV group: (table, kv_start, loc) indices."""
        ps = self.kv.page_size
        width = int((ends.max() + ps - 1) // ps)
        table = self.table.page_tables[g][slots, :width]
        loc = table[row_of_token, positions // ps].astype(np.int64) * ps + positions % ps
        if self.kv.groups[g].window is None:  # full attention never evicts
            kv_start = np.zeros(len(rows), dtype=np.int32)
        else:
            kv_start = np.fromiter(
                (self.kv.kv_start(r.req, g) for r in rows), dtype=np.int32, count=len(rows)
            )
        return stage.add(table, np.int32), stage.add(kv_start, np.int32), stage.add(loc, np.int64)

    def _stage_sampling(self, stage: Staging, slots: IntArray, device_lens: IntArray) -> _StagedSampling:
        """The rows' sampling parameters, staged as two tables (float32 and int64), one row per parameter:
        rows padded to 16 bytes, so each parameter's device view is aligned whatever the batch size
        (Triton builds a kernel variant per pointer alignment)."""
        p = self.params
        n = len(slots)  # sample rows: one per batch row, or per scored position with drafts
        width = -(-n // 4) * 4
        floats = np.empty((len(FLOAT_PARAMS), width), dtype=np.float32)
        floats[:, :n] = p.floats[:, slots]
        ints = np.empty((len(INT_PARAMS) + 1, width), dtype=np.int64)
        ints[: len(INT_PARAMS), :n] = p.ints[:, slots]
        prompt_lens = ints[INT_PARAMS.index("prompt_len"), :n]
        # Outputs scheduled so far: the index of this row's sample.
        steps = np.subtract(device_lens, prompt_lens, out=ints[len(INT_PARAMS), :n])
        temperature, top_p, min_p = floats[0, :n], floats[1, :n], floats[2, :n]
        top_k, logprobs = ints[0, :n], p.logprobs[slots]
        return _StagedSampling(
            floats=stage.add(floats, np.float32),
            ints=stage.add(ints, np.int64),
            rows=n,
            bias=self._stage_bias(stage, slots, steps),
            flags={
                "all_greedy": bool((temperature == 0.0).all()),
                "any_greedy": bool((temperature < GREEDY_EPS).any()),
                "any_top_k_top_p": bool(((top_k > 0) | (top_p < 1.0)).any()),
                "any_min_p": bool((min_p > 0.0).any()),
                "any_explicit_seed": bool(p.explicit_seed[slots].any()),
            },
            num_logprobs=int(logprobs.max()) if n else -1,
        )

    def _stage_bias(self, stage: Staging, slots: IntArray, steps: IntArray) -> dict[str, int]:
        """(row, token, value) triples of logit_bias and of min_tokens' -inf on end tokens; exact under
        the overlap loop, since a row's step index is known at schedule time."""
        p = self.params
        held = steps < p.min_tokens[slots]
        biased = np.flatnonzero(p.has_bias[slots] | held)
        if not len(biased):
            return {}
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row in biased.tolist():
            slot = int(slots[row])
            bias_ids, bias_values = p.bias[slot]
            if held[row]:
                ends = p.end_ids[slot]
                bias_ids, bias_values = [*bias_ids, *ends], [*bias_values, *([-np.inf] * len(ends))]
            rows.extend([row] * len(bias_ids))
            ids.extend(bias_ids)
            values.extend(bias_values)
        return {
            "bias_rows": stage.add(rows, np.int64),
            "bias_ids": stage.add(ids, np.int64),
            "bias_values": stage.add(values, np.float32),
        }

    def _stage_prompt_logprobs(
        self, stage: Staging, rows: list[Row], slots: IntArray, starts: IntArray, lengths: IntArray
    ) -> _StagedPrompt | None:
        """The positions of this step's prompt tokens, in rows that asked for prompt log-probs, whose
        next token is a prompt token too (position p scores token p + 1), with those next tokens. One
        numpy test per batch when no row asked."""
        top = self.params.prompt_logprobs[slots]
        prompt_lens = self.params.prompt_len[slots]
        asked = np.flatnonzero((top >= 0) & (starts < prompt_lens - 1))
        if not len(asked):
            return None
        offsets = np.cumsum(lengths) - lengths  # each row's first token in the batch
        index: list[IntArray] = []
        targets: list[int] = []
        spans: list[tuple[int, int]] = []
        for i in asked.tolist():
            row = rows[i]
            end = min(row.start + row.length, row.req.prompt_len - 1)
            index.append(np.arange(offsets[i], offsets[i] + end - row.start, dtype=np.int64))
            targets.extend(row.req.prompt_ids[row.start + 1 : end + 1])
            spans.append((i, end - row.start))
        return _StagedPrompt(
            index=stage.add(np.concatenate(index), np.int64),
            targets=stage.add(targets, np.int64),
            num_top=int(top[asked].max()),
            rows=tuple(spans),
        )

    def _stage_history(self, stage: Staging, slots: IntArray, device_lens: IntArray) -> int | None:
        if not self.params.has_penalty[slots].any():
            return None
        # Tokens known to the pool before this step's sample (device_lens): the prompt and every
        # earlier output.
        lengths = device_lens
        cols = np.arange(int(lengths.max()))[None, :]
        base = (slots * self.table.max_seq_len)[:, None]
        return stage.add(np.where(cols < lengths[:, None], base + cols, -1), np.int64)


@dataclass(frozen=True)
class _StagedPrompt:
    index: int  # staged int64 [K]: token indices in the batch
    targets: int  # staged int64 [K]
    num_top: int
    rows: tuple[tuple[int, int], ...]  # (row, positions), in the order of `index`


@dataclass(frozen=True)
class _StagedSampling:
    """A SamplingBatch whose tensors are still indices into the staged arrays."""

    floats: int  # [len(FLOAT_PARAMS), rows padded]
    ints: int  # [len(INT_PARAMS) + 1, rows padded]: then the steps
    rows: int
    bias: dict[str, int]
    flags: dict[str, bool]
    num_logprobs: int

    def build(self, sent: Staged) -> SamplingBatch:
        rows = self.rows
        floats = dict(zip(FLOAT_PARAMS, sent.device(self.floats)[:, :rows].unbind(0), strict=True))
        ints = dict(zip((*INT_PARAMS, "steps"), sent.device(self.ints)[:, :rows].unbind(0), strict=True))
        bias = {name: sent.device(i) for name, i in self.bias.items()}
        f = self.flags
        return SamplingBatch(
            temperature=floats["temperature"],
            top_p=floats["top_p"],
            top_k=ints["top_k"],
            min_p=floats["min_p"],
            seeds=ints["seed"],
            steps=ints["steps"],
            presence_penalty=floats["presence_penalty"],
            frequency_penalty=floats["frequency_penalty"],
            repetition_penalty=floats["repetition_penalty"],
            prompt_lens=ints["prompt_len"],
            all_greedy=f["all_greedy"],
            any_greedy=f["any_greedy"],
            any_top_k_top_p=f["any_top_k_top_p"],
            any_min_p=f["any_min_p"],
            any_explicit_seed=f["any_explicit_seed"],
            num_logprobs=self.num_logprobs,
            bias_rows=bias.get("bias_rows"),
            bias_ids=bias.get("bias_ids"),
            bias_values=bias.get("bias_values"),
        )
