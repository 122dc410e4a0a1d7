"""The batch builder's host path: one staging buffer for every array, and sampling values gathered from
per-slot columns. What the engine receives must be exactly what the requests asked for, row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.scheduler.batch_builder import BatchBuilder, Row
from tandem.scheduler.kv_manager import GroupInfo, KVManager
from tandem.scheduler.messages import SamplingSpec
from tandem.scheduler.request import Request
from tandem.scheduler.staging import Staging
from tandem.scheduler.table import RequestTable

CPU = torch.device("cpu")


def test_staging_round_trips_mixed_arrays_at_aligned_offsets() -> None:
    stage = Staging(CPU)
    arrays = [
        (np.arange(5), np.int64),
        (np.array([[1, 2, 3], [4, 5, 6]]), np.int32),  # 24 bytes: the next array must still align
        (np.array([0.5, -1.25, 3.0]), np.float32),  # 12 bytes
        (np.zeros(0), np.int64),
        (np.array([7]), np.int64),
    ]
    handles = [stage.add(a, dtype) for a, dtype in arrays]
    sent = stage.send()
    for handle, (array, dtype) in zip(handles, arrays):
        for view in (sent.host(handle), sent.device(handle)):
            assert view.shape == array.shape
            assert view.numpy().dtype == np.dtype(dtype)
            np.testing.assert_array_equal(view.numpy(), array.astype(dtype))
            # 16 bytes: what Triton specialises its pointer arguments on
            assert view.data_ptr() % 16 == 0 or view.numel() == 0


def test_staging_rejects_dtypes_the_engine_does_not_take() -> None:
    with pytest.raises(TypeError, match="int64, int32 or float32"):
        Staging(CPU).add([True, False], bool)


def make_builder(max_running: int = 8) -> tuple[BatchBuilder, RequestTable, KVManager]:
    table = RequestTable(max_running, 64, 4, 1, CPU)
    kv = KVManager([GroupInfo(0, None, 64)], 4, prefix_cache=False, chunk_size=64)
    return BatchBuilder(table, kv, CPU), table, kv


def admit(builder: BatchBuilder, table: RequestTable, kv: KVManager, rid: int, spec: SamplingSpec) -> Request:
    req = Request(rid, list(range(3 + rid)), spec, seed=1000 + rid)
    assert kv.admit(req, req.prompt_len + spec.max_tokens)
    req.slot = table.acquire()
    builder.admit(req)
    kv.grow(req, req.prompt_len)
    return req


def test_sampling_arrays_and_flags_follow_the_rows() -> None:
    builder, table, kv = make_builder()
    specs = [
        SamplingSpec(max_tokens=4, temperature=0.0),
        SamplingSpec(max_tokens=4, temperature=0.7, top_k=5, seed=42, logprobs=3),
        SamplingSpec(max_tokens=4, temperature=1.3, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
    ]
    reqs = [admit(builder, table, kv, rid, spec) for rid, spec in enumerate(specs)]
    reqs[2].device_len += 2  # two outputs already scheduled for this one
    # Rows in a different order from admission: values must follow the row, not the slot order.
    order = [2, 0, 1]
    rows = [Row(reqs[i], reqs[i].device_len - 1, 1, True) for i in order]
    batch = builder.build(0, rows)
    s = batch.sampling
    torch.testing.assert_close(s.temperature, torch.tensor([1.3, 0.0, 0.7]))
    torch.testing.assert_close(s.top_p, torch.tensor([0.9, 1.0, 1.0]))
    assert s.top_k.tolist() == [-1, -1, 5]
    torch.testing.assert_close(s.min_p, torch.tensor([0.1, 0.0, 0.0]))
    torch.testing.assert_close(s.repetition_penalty, torch.tensor([1.2, 1.0, 1.0]))
    assert s.seeds.tolist() == [1002, 1000, 1001]  # as the scheduler derived them (here: given)
    assert s.steps.tolist() == [2, 0, 0]
    assert s.prompt_lens.tolist() == [5, 3, 4]
    assert (s.all_greedy, s.any_greedy, s.any_top_k_top_p, s.any_min_p) == (False, True, True, True)
    assert s.any_explicit_seed and s.num_logprobs == 3
    assert batch.history_index is not None and batch.history_index.shape[0] == 3  # row 0 has a penalty
    assert batch.seq_lens_cpu.tolist() == [r.req.device_len for r in rows]


def test_plain_rows_skip_every_optional_path() -> None:
    builder, table, kv = make_builder()
    reqs = [admit(builder, table, kv, rid, SamplingSpec(max_tokens=4, temperature=0.6)) for rid in range(3)]
    batch = builder.build(0, [Row(r, r.device_len - 1, 1, True) for r in reqs])
    s = batch.sampling
    flags = (s.all_greedy, s.any_greedy, s.any_top_k_top_p, s.any_min_p, s.any_explicit_seed)
    assert flags == (False, False, False, False, False)
    assert s.num_logprobs == -1 and batch.history_index is None
