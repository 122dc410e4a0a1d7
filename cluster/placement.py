"""Placement groups for one TP group: `tp_size` bundles, the replica's own CPUs merged into bundle 0."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from tandem.cluster.ray_cluster import cluster_resources_summary

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def rank_bundles(
    tp_size: int, *, use_gpu: bool, cpus_per_rank: float = 1.0, replica_cpus: float = 0.0
) -> list[dict[str, float]]:
    """Bundle i holds rank i. Bundle 0 also holds the replica actor, so it stays next to rank 0."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    bundles: list[dict[str, float]] = []
    for i in range(tp_size):
        bundle: dict[str, float] = {"CPU": cpus_per_rank + (replica_cpus if i == 0 else 0.0)}
        if use_gpu:
            bundle["GPU"] = 1.0
        bundles.append(bundle)
    return bundles


def reserve(
    bundles: list[dict[str, float]], strategy: str = "STRICT_PACK", timeout_s: float = 60.0
) -> PlacementGroup:
    """Create a placement group and wait for it; fail with a clear message instead of hanging."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    pg: PlacementGroup = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not place {len(bundles)} rank bundle(s) {bundles} with {strategy} within "
            f"{timeout_s:g}s; the cluster has {cluster_resources_summary()}"
        )
    return pg


def release(pg: PlacementGroup | None) -> None:
    if pg is not None:
        remove_placement_group(pg)
