"""In-app admission control of one LLMServer replica: run a bounded number, queue a bounded number more.

The LLMServer is the HTTP ingress itself (one Serve hop), so Serve's own `max_queued_requests` would turn
overload away at the proxy, in plain text. Serve is therefore told to admit more than the replica runs
(see `app.py`), and this class applies the replica's running bound and queue bound inside the replica,
where a request past the queue becomes an OpenAI-shaped 503 at once.

The running bound defaults to what the engine runs at once, known only once the replica's ranks are up
(`resize`). A slot is given back when its job's last token arrives from the engine, not when a slow
client has finished reading it: the engine's batch, not the clients' pace, sets how many run.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from tandem.deploy.errors import overloaded

Release = Callable[[], None]


class Admission:
    """At most `max_running` jobs hold a slot; at most `max_queued` more wait for one (-1: no bound).

    Taking a free slot does not yield to the event loop, so an idle replica adds no latency here.
    """

    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def resize(self, max_running: int, max_queued: int | None = None) -> None:
        """Change the bounds; waiters that now fit start at once."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        if max_queued is not None:
            self.max_queued = max_queued
        self._wake()

    async def acquire(self) -> Release:
        """Wait for a running slot; return its (idempotent) release. Raises the overloaded `OpenAIError`
        at once if the queue is full."""
        if self.running >= self.max_running or self._waiters:
            if 0 <= self.max_queued <= len(self._waiters):
                raise overloaded(
                    f"the server is overloaded ({self.running} requests running and {self.waiting} "
                    f"queued on this replica); retry later"
                )
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._give_back()  # the slot was handed over as the waiter was cancelled
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        else:
            self.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._give_back()

        return release

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the body."""
        release = await self.acquire()
        try:
            yield
        finally:
            release()

    def _give_back(self) -> None:
        self.running -= 1
        self._wake()

    def _wake(self) -> None:
        # A slot passes straight to the oldest waiter, so a newcomer cannot overtake the queue.
        while self._waiters and self.running < self.max_running:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)
