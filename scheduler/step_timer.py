"""Wall time per phase of the scheduler loop, cheap enough to stay on (two perf_counter calls a phase).

Each phase is also a `torch.profiler.record_function` range, so a trace shows the same names. Without a
profiler, the totals answer the first question about a slow run: is the step bound by the host
(schedule + launch + processing) or by the device (`wait`, the time blocked on the copy-done event)?
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import record_function


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with record_function(f"tandem.{name}"):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: total seconds, calls, and mean milliseconds per call."""
        return {
            name: {
                "total_s": round(total, 6),
                "calls": self.calls[name],
                "mean_ms": round(1e3 * total / self.calls[name], 4),
            }
            for name, total in self.seconds.items()
        }
