"""Where a LoRA adapter's requests go: to the replicas that hold it, as Serve's model multiplexing reports
them (`RunningReplica.multiplexed_model_ids`), or as this router placed it itself in the last few seconds
(the reports lag the first request that loads it, and a burst must not load it on every replica).

A replica loads an adapter only when none holds it, or when every holder is full: more than the router's
imbalance threshold busier than the least loaded replica. A new adapter goes to the replica holding the
fewest adapters, then the least loaded, so adapters spread over the replicas as prefixes do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ray.serve.request_router import RunningReplica

# How long the router's own placement counts as a holder before the replica's report must confirm it.
PLACEMENT_TTL_S = 10.0


class AdapterPlacements:
    def __init__(self, ttl_s: float = PLACEMENT_TTL_S) -> None:
        self._ttl = ttl_s
        self._placed: dict[str, dict[str, float]] = {}  # adapter -> replica -> when the router sent it there

    def holders(self, adapter: str, candidates: Sequence[RunningReplica]) -> list[RunningReplica]:
        """The candidates that hold `adapter`, by their report or a recent placement."""
        now = time.monotonic()
        placed = {t for t, at in self._placed.get(adapter, {}).items() if now - at < self._ttl}
        return [
            r
            for r in candidates
            if adapter in r.multiplexed_model_ids or r.replica_id.to_full_id_str() in placed
        ]

    def held_count(self, replica: RunningReplica) -> int:
        tenant = replica.replica_id.to_full_id_str()
        now = time.monotonic()
        mine = {a for a, where in self._placed.items() if now - where.get(tenant, -1e18) < self._ttl}
        return len(set(replica.multiplexed_model_ids) | mine)

    def pick(
        self,
        adapter: str,
        candidates: Sequence[RunningReplica],
        load: Callable[[RunningReplica], float],
        imbalance: float,
        among: Callable[[Sequence[RunningReplica]], RunningReplica],
    ) -> RunningReplica:
        """The replica for a request of `adapter`: `among(holders)` (the prefix-aware choice) unless every
        holder is full; else a new one, which will load it."""
        least = min(load(r) for r in candidates)
        holders = self.holders(adapter, candidates)
        room = [r for r in holders if load(r) - least <= imbalance]
        if room:
            chosen = among(room)
            self.record(adapter, chosen)
            return chosen
        others = [r for r in candidates if r not in holders] or list(candidates)
        chosen = min(others, key=lambda r: (self.held_count(r), load(r)))
        self.record(adapter, chosen)
        return chosen

    def record(self, adapter: str, replica: RunningReplica) -> None:
        self._placed.setdefault(adapter, {})[replica.replica_id.to_full_id_str()] = time.monotonic()

    def forget_replica(self, tenant: str) -> None:
        for where in self._placed.values():
            where.pop(tenant, None)
