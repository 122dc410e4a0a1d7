"""Spawns a replica's rank actors into its placement group, wires them up and watches them."""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster import placement
from tandem.replicas.channel import ChannelAddress
from tandem.replicas.rank_worker import RankWorker
from tandem.replicas.watchdog import Beat, Problem, RankWatchdog
from tandem.scheduler.runtime import RuntimeLimits, RuntimeOptions

RankActor: Any = ray.remote(RankWorker)


class RankGroup:
    """The `tp_size` rank actors of one replica, one per bundle of its placement group.

    Inside a Serve replica the group uses the replica's own placement group (Serve reserved it from
    `placement_group_bundles`); given a `placement_group` (a batch actor's), it uses that one; elsewhere
    (`tandem.LLM(tp_size>1)`) it reserves one and releases it.
    """

    def __init__(
        self,
        tp_size: int,
        *,
        use_gpu: bool,
        cpus_per_rank: float = 1.0,
        strategy: str = "STRICT_PACK",
        timeout_s: float = 120.0,
        placement_group: PlacementGroup | None = None,
    ) -> None:
        self.tp_size = tp_size
        self.use_gpu = use_gpu
        self.cpus_per_rank = cpus_per_rank
        self.strategy = strategy
        self.timeout_s = timeout_s
        self.actors: list[Any] = []
        self._own_pg: PlacementGroup | None = None
        self._given_pg = placement_group

    def _placement_group(self) -> PlacementGroup:
        if self._given_pg is not None:
            return self._given_pg
        current = get_current_placement_group()
        if current is not None:
            return current
        bundles = placement.rank_bundles(self.tp_size, use_gpu=self.use_gpu, cpus_per_rank=self.cpus_per_rank)
        self._own_pg = placement.reserve(bundles, self.strategy, self.timeout_s)
        return self._own_pg

    def start(self, model_dir: str, options: RuntimeOptions, channel: ChannelAddress | None) -> RuntimeLimits:
        """Create the actors, order them by node and GPU, join the TP group, load the model."""
        pg = self._placement_group()
        actors = [
            RankActor.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=1 if self.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=True
                ),
            ).remote()
            for i in range(self.tp_size)
        ]
        self.actors = actors
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(
                f"rank actors for tp_size={self.tp_size} could not be scheduled within {self.timeout_s:g}s"
            ) from exc
        # Bundle 0 stays rank 0 (it sits with the replica); the rest follow node, then GPU id.
        order = [0] + sorted(range(1, len(actors)), key=lambda i: (infos[i]["node_ip"], infos[i]["gpu_ids"]))
        self.actors = [actors[i] for i in order]
        master = ray.get(self.actors[0].pick_port.remote())
        limits = ray.get(
            [
                actor.setup.remote(
                    rank, self.tp_size, master, model_dir, options, channel if rank == 0 else None
                )
                for rank, actor in enumerate(self.actors)
            ]
        )
        first: RuntimeLimits = limits[0]
        return first

    def problems(self, watchdog: RankWatchdog, timeout_s: float = 5.0) -> list[Problem]:
        """Why this group is unhealthy: dead or stopped actors, crashed loops, stuck ranks."""
        found: list[Problem] = []
        refs = [a.heartbeat.remote() for a in self.actors]
        # One deadline for all: a stopped rank costs `timeout_s` once, not once per rank after it; and
        # never longer than the stuck-rank timeout, so a stopped process is found as fast as a stuck one.
        timeout_s = min(timeout_s, watchdog.stuck_after_s)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
        for rank, ref in enumerate(refs):
            beat: Beat | BaseException = TimeoutError(f"no heartbeat within {timeout_s:g}s")
            if ref in ready:
                try:
                    beat = Beat(*ray.get(ref))
                except ray.exceptions.RayActorError as exc:
                    beat = exc
            problem = watchdog.judge(rank, beat)
            if problem is not None:
                found.append(problem)
        return found

    def stop(self, graceful_s: float = 5.0) -> None:
        if self.actors:
            stops = [a.stop.remote() for a in self.actors]
            # A dead actor must not block the rest of the teardown.
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=graceful_s)
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
        placement.release(self._own_pg)
        self._own_pg = None
