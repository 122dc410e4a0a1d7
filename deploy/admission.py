"""In-app admission control of one LLMServer replica: run a bounded number, queue a bounded number more.

The LLMServer is the HTTP ingress itself (one Serve hop), so Serve's own `max_queued_requests` would turn
overload away at the proxy, in plain text. Serve is therefore told to admit more than the replica runs
(see `app.py`), and this class applies the user's `max_ongoing_requests` / `max_queued_requests` inside
the replica, where a request past the queue becomes an OpenAI-shaped 503 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tandem.deploy.errors import overloaded


class Admission:
    """At most `max_running` jobs hold a slot; at most `max_queued` more wait for one (-1: no bound).

    Taking a free slot does not yield to the event loop, so an idle replica adds no latency here.
    """

    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the body; raise the overloaded `OpenAIError` if the queue is full."""
        if self.running >= self.max_running and 0 <= self.max_queued <= self.waiting:
            raise overloaded(
                f"the server is overloaded ({self.running} requests running and {self.waiting} queued "
                f"on this replica); retry later"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
