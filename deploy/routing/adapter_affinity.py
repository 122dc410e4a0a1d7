"""Where a LoRA adapter's requests go: to the replicas that hold it, as Serve's model multiplexing reports
them (`RunningReplica.multiplexed_model_ids`), or as this router placed it itself in the last few seconds
(the reports lag the first request that loads it, and a burst must not load it on every replica).

A replica loads an adapter only when none holds it, or when every holder is full: more than the router's
imbalance threshold busier than the least loaded replica. The replica for a new adapter is the one that
ranks first for it by rendezvous hashing, among those within the threshold. The rank depends only on the
adapter's name and the replicas' ids, so every router (HAProxy's route hook, each process's handle) sends
a new adapter to the same replica without waiting for any report; over many adapters it spreads them
evenly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from ray.serve.request_router import RunningReplica

# How long the router's own placement counts as a holder before the replica's report must confirm it.
PLACEMENT_TTL_S = 10.0


def rendezvous_rank(adapter: str, replica: RunningReplica) -> bytes:
    """The replica's rank for `adapter` (highest first): the same in every process, unlike `hash`."""
    key = f"{adapter}\x00{replica.replica_id.to_full_id_str()}".encode()
    return hashlib.blake2b(key, digest_size=8).digest()


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

    def pick(
        self,
        adapter: str,
        candidates: Sequence[RunningReplica],
        load: Callable[[RunningReplica], float],
        imbalance: float,
        among: Callable[[Sequence[RunningReplica]], RunningReplica],
    ) -> RunningReplica:
        """The replica for a request of `adapter`: `among(holders)` (the prefix-aware choice) unless every
        holder is full; else the first by rendezvous rank of the others with room, which will load it."""
        least = min(load(r) for r in candidates)
        holders = self.holders(adapter, candidates)
        room = [r for r in candidates if load(r) - least <= imbalance]  # never empty: the least loaded
        held = [r for r in holders if r in room]
        if held:
            chosen = among(held)
        else:  # the least loaded replica is no holder here, so `others` is not empty
            others = [r for r in room if r not in holders]
            chosen = max(others, key=lambda r: rendezvous_rank(adapter, r))
        self.record(adapter, chosen)
        return chosen

    def record(self, adapter: str, replica: RunningReplica) -> None:
        self._placed.setdefault(adapter, {})[replica.replica_id.to_full_id_str()] = time.monotonic()

    def forget_replica(self, tenant: str) -> None:
        for where in self._placed.values():
            where.pop(tenant, None)
