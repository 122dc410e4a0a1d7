"""In-app admission control of one LLMServer replica: run a bounded number, queue a bounded number more.

The LLMServer is the HTTP ingress itself (one Serve hop), so Serve's own `max_queued_requests` would turn
overload away at the proxy, in plain text. Serve is therefore told to admit more than the replica runs
(see `app.py`), and this class applies the replica's running bound and queue bound inside the replica,
where a request past the queue becomes an OpenAI-shaped 503 at once.

The running bound defaults to what the engine runs at once, known only once the replica's ranks are up.
A job's slots are given back when its last token arrives from the engine, not when a slow client has
finished reading it: the engine's batch, not the clients' pace, sets how many run.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from tandem.deploy.protocol.errors import overloaded

Release = Callable[[], None]


class Admission:
    """At most `max_running` choices hold slots; at most `max_queued` more jobs wait for theirs (-1: no
    bound). A job weighs its number of choices (capped at `max_running`, so any job can run alone);
    waiting jobs are served in arrival order, so a heavy one is not passed over forever.

    Taking free slots does not yield to the event loop, so an idle replica adds no latency here.
    """

    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.running = 0  # slots held: choices of the running jobs
        self.waiting = 0  # jobs waiting

    async def acquire(self, weight: int = 1) -> Release:
        """Wait for `weight` running slots; return their (idempotent) release. Raises the overloaded
        `OpenAIError` at once if the queue is full."""
        weight = min(max(weight, 1), self.max_running)
        if not self._waiters and self.running + weight <= self.max_running:
            self.running += weight
        else:
            if 0 <= self.max_queued <= self.waiting:
                raise overloaded(
                    f"the server is overloaded ({self.running} choices running and {self.waiting} "
                    f"requests queued on this replica); retry later"
                )
            await self._wait(weight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.running -= weight
                self._wake()

        return release

    @asynccontextmanager
    async def slot(self, weight: int = 1) -> AsyncIterator[None]:
        """Hold `weight` running slots for the body."""
        release = await self.acquire(weight)
        try:
            yield
        finally:
            release()

    async def _wait(self, weight: int) -> None:
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (weight, granted)
        self._waiters.append(entry)
        self.waiting += 1
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.running -= weight  # granted as we were cancelled: hand the slots on
            elif entry in self._waiters:
                self._waiters.remove(entry)
            self._wake()  # a heavy job leaving the head may let lighter ones in
            raise
        finally:
            self.waiting -= 1

    def _wake(self) -> None:
        while self._waiters and self.running + self._waiters[0][0] <= self.max_running:
            weight, granted = self._waiters.popleft()
            if granted.done():  # cancelled while queued
                continue
            self.running += weight
            granted.set_result(None)
