"""The placement group of one batch actor's rank actors, named after the actor.

Ray restarts a crashed actor under the same id, and the restarted actor finds its group by that name, with
the bundles free again (the old rank actors died with their owner): a crash never strands a group holding
GPUs. The group is reserved from inside the actor, not handed to Ray Data as the actor's own scheduling
strategy, because Ray Data also calls its `ray_remote_args_fn` for other reasons (its memory checks),
and each such call would reserve a group that nothing uses or removes. An actor killed before it could
clean up (Ray Data kills those still starting when a dataset ends) leaves its group behind:
`release_orphan_groups` removes those, at the start of each job.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)

from tandem.cluster import placement
from tandem.cluster.ray_cluster import cluster_resources_summary

logger = logging.getLogger(__name__)
WAIT_LOG_PERIOD_S = 60.0
GROUP_PREFIX = "tandem-batch-"


def reserve_actor_group(bundles: list[dict[str, float]], strategy: str) -> PlacementGroup:
    """This actor's group (the one it had before a restart, or a new one), once it is placed. It waits as
    long as it takes: Ray Data shows a waiting actor as pending, and a cluster may still grow."""
    if strategy not in placement.STRATEGIES:
        raise ValueError(f"placement strategy must be one of {', '.join(placement.STRATEGIES)}")
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    name = f"{GROUP_PREFIX}{actor_id}" if actor_id else ""
    group: PlacementGroup | None
    try:
        group = get_placement_group(name) if name else None
    except ValueError:  # no such group: this is the actor's first start
        group = None
    if group is None:
        # Near this actor when the strategy allows: rank 0 streams every step's tokens to it.
        target = context.get_node_id() if strategy == "STRICT_PACK" else None
        group = placement_group(bundles, strategy=strategy, name=name, _soft_target_node_id=target)
    waited = 0.0
    while not group.wait(timeout_seconds=int(WAIT_LOG_PERIOD_S)):
        waited += WAIT_LOG_PERIOD_S
        logger.warning(
            "tandem batch: waiting %.0fs for rank bundles %s (%s); the cluster has %s",
            waited,
            bundles,
            strategy,
            cluster_resources_summary(),
        )
    return group


def release_orphan_groups() -> int:
    """Remove the groups of batch actors that are gone: Ray Data kills an actor still starting when a
    dataset ends, and a killed actor runs no cleanup. Returns how many it removed."""
    import ray._private.state  # the GCS actor table; Ray's public state API needs the dashboard

    removed = 0
    for group_id, group in ray.util.placement_group_table().items():
        name = str(group.get("name") or "")
        if not name.startswith(GROUP_PREFIX) or group.get("state") == "REMOVED":
            continue
        actor = ray._private.state.actors(name[len(GROUP_PREFIX) :])
        if actor and actor.get("State") != "DEAD":
            continue
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
        removed += 1
    return removed
