"""Wall time per phase of the scheduler loop, cheap enough to stay on (two perf_counter calls a phase).

While a profiler runs, each phase is also a `torch.profiler.record_function` range, so a trace shows the
same names. Without a profiler, the totals answer the first question about a slow run: is the step bound
by the host (schedule + launch + processing) or by the device (`wait`, the time blocked on the copy-done
event)?
The longest call and the count of calls over `STALL_S` answer the second: is a slow phase slow on every
step, or on a few that stalled (a kernel build, a pinned allocation, a hidden synchronisation)?
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

STALL_S = 0.010  # a call this long is a stall: a whole decode step of a small model takes a few ms


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.longest: dict[str, float] = {}
        self.stalls: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            if _profiler_enabled():  # a range costs tens of µs to open even with no profiler to see it
                with record_function(f"tandem.{name}"):
                    yield
            else:
                yield
        finally:
            took = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + took
            self.calls[name] = self.calls.get(name, 0) + 1
            self.longest[name] = max(self.longest.get(name, 0.0), took)
            self.stalls[name] = self.stalls.get(name, 0) + (took >= STALL_S)

    def reset(self) -> None:
        for totals in (self.seconds, self.calls, self.longest, self.stalls):
            totals.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: total seconds, calls, mean and longest milliseconds per call, and stalled calls."""
        return {
            name: {
                "total_s": round(total, 6),
                "calls": self.calls[name],
                "mean_ms": round(1e3 * total / self.calls[name], 4),
                "max_ms": round(1e3 * self.longest[name], 4),
                "stalls": self.stalls[name],
            }
            for name, total in self.seconds.items()
        }
