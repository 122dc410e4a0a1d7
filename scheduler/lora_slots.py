"""Which LoRA adapter each GPU slot of one rank holds, the rank's host cache of read adapters, and the
admission rule that keeps a running batch within `max_loras` adapters.

A request with an adapter is admitted only with a slot for it: its adapter's own slot, an empty one, or
one whose adapter no running request uses (the least recently used such adapter is evicted, and the new
one is copied in on the scheduler stream, ahead of the batch that needs it; slots are released under the
deferred-free rule, so no launched batch still reads the old contents). A request whose adapter finds no
slot waits without holding up others; requests of one adapter keep their order. So that a waiting
adapter is not starved by adapters whose requests keep coming, each pass picks, for each adapter that
waited for a slot in the last pass, one busy adapter (the least recently admitted) to drain: its new
requests wait until its running ones finish, and its slot goes to the adapter that waited longest.

Everything is decided from the messages in order, with ticks for recency: every TP rank holds the same
adapters in the same slots.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from tandem.scheduler.messages import LoRARequest


class Adapter(Protocol):
    """An adapter read for this rank (engine/lora/runtime.py `HostAdapter`)."""

    @property
    def nbytes(self) -> int: ...


class AdapterLoader(Protocol):
    """What the slots need of the engine (engine/lora/runtime.py `EngineLora`)."""

    def read(self, path: str) -> Any: ...

    def load(self, slot: int, adapter: Any) -> None: ...


class AdapterSlots:
    def __init__(self, loader: AdapterLoader, max_loras: int, max_cpu_loras: int) -> None:
        self.loader = loader
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self._host: OrderedDict[int, Adapter] = OrderedDict()  # LRU first
        self._paths: dict[int, str] = {}
        self._holder: list[int | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}
        self._users: dict[int, int] = {}  # admitted requests per adapter, until they are released
        self._last_use: dict[int, int] = {}  # the tick of each resident adapter's last admission
        self._tick = 0
        self._blocked: list[int] = []  # adapters that found no slot in this pass, in queue order
        self._draining: set[int] = set()
        self._dropped: set[int] = set()  # unloaded while in use: freed at the last release
        self.counts = {"loads": 0, "evictions": 0, "reads": 0, "host_evictions": 0}

    # ---- the host cache --------------------------------------------------------------------------
    def prefetch(self, lora: LoRARequest) -> str | None:
        """Make sure the adapter is read (into the host cache, unless it sits in a slot); why it cannot
        be, or None."""
        self._dropped.discard(lora.id)
        known = self._paths.get(lora.id)
        if known is not None and known != lora.path:
            return f"LoRA id {lora.id} is already {known!r}; an adapter at another path needs another id"
        self._paths[lora.id] = lora.path
        if lora.id in self._slot_of:
            return None
        try:
            self._host_adapter(lora)
        except (OSError, ValueError) as exc:
            return str(exc)
        return None

    def _host_adapter(self, lora: LoRARequest) -> Adapter:
        cached = self._host.get(lora.id)
        if cached is not None:
            self._host.move_to_end(lora.id)
            return cached
        adapter: Adapter = self.loader.read(lora.path)
        self.counts["reads"] += 1
        self._host[lora.id] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
            self.counts["host_evictions"] += 1
        return adapter

    def forget(self, lora_id: int) -> None:
        """Drop an adapter: from the host cache now, from its slot once no running request uses it."""
        self._host.pop(lora_id, None)
        self._paths.pop(lora_id, None)
        if self._users.get(lora_id, 0) > 0:
            self._dropped.add(lora_id)
        else:
            self._free(lora_id)

    def _free(self, lora_id: int) -> None:
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._holder[slot] = None
        self._last_use.pop(lora_id, None)

    # ---- admission -------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """Start a scheduling pass: pick the adapters to drain for those that waited in the last one."""
        free = sum(1 for lora_id in self._holder if lora_id is None or self._users.get(lora_id, 0) == 0)
        want = max(0, min(len(self._blocked), self.max_loras) - free)
        busy = sorted((self._last_use[i], i) for i in self._slot_of if self._users.get(i, 0) > 0)
        self._draining = {i for _, i in busy[:want]}
        self._blocked = []

    def admissible(self, lora: LoRARequest) -> bool:
        """Whether a request of this adapter may be admitted in this pass (no slot changes yet)."""
        if lora.id in self._draining:
            return False
        if lora.id in self._slot_of or self._slot_to_take() is not None:
            return True
        if lora.id not in self._blocked:
            self._blocked.append(lora.id)
        return False

    def _slot_to_take(self) -> int | None:
        """An empty slot, else the slot of the least recently used adapter no request uses."""
        idle = None
        for slot, lora_id in enumerate(self._holder):
            if lora_id is None:
                return slot
            if self._users.get(lora_id, 0) == 0 and (idle is None or self._last_use[lora_id] < idle[0]):
                idle = (self._last_use[lora_id], slot)
        return None if idle is None else idle[1]

    def acquire(self, lora: LoRARequest) -> int:
        """The slot of an admitted request's adapter, loading it there if needed (`admissible` said
        yes). Raises OSError or ValueError if the adapter can no longer be read."""
        self._tick += 1
        slot = self._slot_of.get(lora.id)
        if slot is None:
            adapter = self._host_adapter(lora)
            slot = self._slot_to_take()
            assert slot is not None, "acquire without admissible"
            old = self._holder[slot]
            if old is not None:
                self._free(old)
                self.counts["evictions"] += 1
            self.loader.load(slot, adapter)
            self.counts["loads"] += 1
            self._holder[slot] = lora.id
            self._slot_of[lora.id] = slot
        self._users[lora.id] = self._users.get(lora.id, 0) + 1
        self._last_use[lora.id] = self._tick
        return slot

    def release(self, lora_id: int) -> None:
        """A request of this adapter is done, and no unprocessed batch holds it."""
        left = self._users.get(lora_id, 0) - 1
        if left > 0:
            self._users[lora_id] = left
            return
        self._users.pop(lora_id, None)
        if lora_id in self._dropped:
            self._dropped.discard(lora_id)
            self._free(lora_id)

    def stats(self) -> dict[str, Any]:
        return {
            "lora_slots": self.max_loras,
            "lora_slots_used": len(self._slot_of),
            "lora_active": sum(1 for n in self._users.values() if n > 0),
            "lora_host_cached": len(self._host),
            "lora_host_bytes": sum(a.nbytes for a in self._host.values()),
            "lora_loads": self.counts["loads"],
            "lora_evictions": self.counts["evictions"],
            "lora_reads": self.counts["reads"],
            "lora_host_evictions": self.counts["host_evictions"],
        }
