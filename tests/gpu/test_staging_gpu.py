"""The batch uploads' pinned buffers on CUDA: each batch's device arrays hold its own values, however many
batches have reused the pinned buffers since, and the stream waits with reused events order the copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.engine.streams import StreamSet
from tandem.scheduler.staging import PinnedSlots, Staging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")


def test_reused_pinned_buffers_keep_every_batch_exact() -> None:
    slots = PinnedSlots(count=2)
    rng = np.random.default_rng(0)
    kept: list[tuple[list[np.ndarray], list[torch.Tensor]]] = []
    for step in range(12):
        # Sizes grow and shrink, so buffers are both reused and replaced by larger ones.
        rows = 1 + (step * 37) % 300
        arrays = [rng.integers(-(2**40), 2**40, rows), rng.random((2, rows), dtype=np.float32)]
        stage = Staging(DEVICE, slots)
        handles = [stage.add(arrays[0], np.int64), stage.add(arrays[1], np.float32)]
        sent = stage.send()
        views = [sent.device(h) for h in handles]
        kept.append((arrays, views))
        np.testing.assert_array_equal(sent.host(handles[1]).numpy(), arrays[1])
        assert all(view.data_ptr() % 16 == 0 for view in views)
    torch.cuda.synchronize()
    for arrays, views in kept:
        np.testing.assert_array_equal(views[0].cpu().numpy(), arrays[0])
        np.testing.assert_array_equal(views[1].cpu().numpy(), arrays[1])


def test_waits_with_reused_events_order_the_streams() -> None:
    streams = StreamSet(DEVICE)
    data = torch.zeros(1 << 22, device=DEVICE)
    for value in range(1, 6):
        with streams.use(streams.scheduler):
            torch.cuda._sleep(2_000_000)  # about a millisecond: the engine stream would overtake it
            data.fill_(float(value))
        streams.wait(streams.engine, on=streams.scheduler)
        with streams.use(streams.engine):
            total = data.sum().item()  # synchronizes the engine stream only
        assert total == value * data.numel()
