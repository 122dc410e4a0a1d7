"""CUDA streams and events, with stand-ins on CPU so the loops run the same code everywhere.

Each rank owns one `StreamSet`; nothing here is process-global. On CPU every operation is
synchronous, so the stand-ins only track which stream is "current" so the loops' stream assertions
still hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class HostEvent:
    """An event for work that is already complete when it is recorded (CPU execution)."""

    def record(self, stream: Stream | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class HostStream:
    """A named CPU stand-in: work on CPU runs in order on the calling thread."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: Stream) -> None:
        return None

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


Stream = torch.cuda.Stream | HostStream
Event = torch.cuda.Event | HostEvent


class StreamSet:
    """The scheduler, engine and copy streams of one rank, and which of them is current."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.scheduler: Stream
        self.engine: Stream
        self.copy: Stream
        if self.is_cuda:
            self.scheduler = torch.cuda.Stream(device)
            self.engine = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)
        else:
            self.scheduler = HostStream("scheduler")
            self.engine = HostStream("engine")
            self.copy = HostStream("copy")
        self._host_current: Stream = self.scheduler
        # The device's index, resolved once: torch's stream calls given no index (or a device without
        # one) look the current device up through several Python layers on every call, a visible share
        # of a small model's per-step host time.
        self._index = (
            (device.index if device.index is not None else torch.cuda.current_device()) if self.is_cuda else 0
        )
        # One event per (waiting, waited-on) pair, recorded again for each wait: torch's `wait_stream`
        # creates and destroys an event per call, host time the loop pays several times a step. A wait
        # already queued keeps the state the event had when it was queued, so reuse is safe.
        self._marks: dict[tuple[int, int], torch.cuda.Event] = {}

    def current(self) -> Stream:
        if self.is_cuda:
            return torch.cuda.current_stream(self._index)
        return self._host_current

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        if self.is_cuda:
            # `torch.cuda.stream(stream)` without its device lookups: swap the current stream, restore it.
            assert isinstance(stream, torch.cuda.Stream)
            prior = torch.cuda.current_stream(self._index)
            torch.cuda.set_stream(stream)
            try:
                yield
            finally:
                torch.cuda.set_stream(prior)
            return
        previous: Stream = self._host_current
        self._host_current = stream
        try:
            yield
        finally:
            self._host_current = previous

    def wait(self, stream: Stream, on: Stream) -> None:
        """Make later work on `stream` wait for work already queued on `on`."""
        if isinstance(stream, torch.cuda.Stream) and isinstance(on, torch.cuda.Stream):
            key = (stream.stream_id, on.stream_id)
            mark = self._marks.get(key)
            if mark is None:
                mark = self._marks[key] = torch.cuda.Event()
            mark.record(on)
            stream.wait_event(mark)

    def hand_over(self, tensors: Iterable[torch.Tensor], to: Stream) -> None:
        """Pass `tensors`, just written on the current stream, to `to`: later work on `to` waits for the
        current stream's work so far, and the caching allocator keeps their memory until `to` is done
        with them."""
        if isinstance(to, torch.cuda.Stream):
            self.wait(to, on=self.current())
            for tensor in tensors:
                tensor.record_stream(to)

    def new_event(self) -> Event:
        if self.is_cuda:
            return torch.cuda.Event()
        return HostEvent()

    def is_current(self, stream: Stream) -> bool:
        return self.current() == stream
