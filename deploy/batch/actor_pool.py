"""How an engine stage runs on Ray Data: an actor pool, one engine per actor, whose rank actors sit one
per bundle of a placement group the actor reserves (`actor_group.py`), through the serving replicas'
`RankGroup`.

Ray Data keeps its defaults for faults: an actor that dies is restarted and the batches it held are run
again there, so a crash loses no row and, since a batch's output is committed only when it is done,
duplicates none.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from ray.data import ActorPoolStrategy

from tandem.cluster import placement
from tandem.cluster.ray_cluster import cluster_can_grow, cluster_resources_summary
from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.host import EngineSpec
from tandem.deploy.protocol.templates import load_chat_template

logger = logging.getLogger(__name__)
# The stage actor itself: tokenizing, detokenizing, Arrow in and out. It mostly waits on its rank actors,
# so it reserves a sliver: a whole CPU each starved Ray Data's own tasks on a small cluster.
ACTOR_CPUS = 0.25
DATA_TASK_CPUS = 1.0  # Ray Data's own tasks beside the actors (reading, repartitioning, pre/postprocess)


class PoolCannotBePlaced(RuntimeError):
    """The actor pool needs more than the cluster has, and no autoscaler can add it."""


def pool_needs(bundles: list[dict[str, float]], actors: int) -> dict[str, float]:
    """CPUs and GPUs that `actors` engines with these rank bundles, and Ray Data's tasks, reserve."""
    return {
        "CPU": actors * (ACTOR_CPUS + sum(b.get("CPU", 0.0) for b in bundles)) + DATA_TASK_CPUS,
        "GPU": actors * sum(b.get("GPU", 0.0) for b in bundles),
    }


def local_cluster_cpus(config: ProcessorConfig) -> int:
    """Logical CPUs for a Ray this process starts itself: the cores, or what the largest pool reserves
    if more (rank actors on GPUs mostly wait; on CPU they share the cores, as torch threads would)."""
    bundles = placement.rank_bundles(config.tp_size, use_gpu=False, cpus_per_rank=config.cpus_per_rank)
    return max(os.cpu_count() or 1, math.ceil(pool_needs(bundles, config.pool_size[1])["CPU"]))


def engine_spec(config: ProcessorConfig) -> EngineSpec:
    """The actors' engine, resolved here in the driver: the device, and the template file's text."""
    return EngineSpec(
        model=config.model_source,
        tp_size=config.tp_size,
        device=resolve_device(config.device),
        engine=dict(config.engine_kwargs),
        placement_strategy=config.placement_strategy,
        cpus_per_rank=config.cpus_per_rank,
        accelerator_type=config.accelerator_type,
        chat_template=load_chat_template(config.chat_template),
    )


def resolve_device(device: str) -> str:
    """'cpu' or 'cuda': the bundles must say now whether ranks take a GPU. 'auto' is CUDA when the Ray
    cluster has GPUs (connect first); a cluster whose GPU nodes autoscale from zero needs 'cuda'."""
    if device != "auto":
        return device
    import ray

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    return "cuda" if gpus > 0 else "cpu"


def map_batches_kwargs(config: ProcessorConfig, spec: EngineSpec, **constructor: Any) -> dict[str, Any]:
    """`Dataset.map_batches` arguments for an engine stage class built with `spec` (and `constructor`)."""
    low, high = config.pool_size
    check_placeable(spec.bundles(), low)
    kwargs: dict[str, Any] = {
        "fn_constructor_kwargs": {"spec": spec, **constructor},
        "batch_size": config.batch_size,
        "batch_format": "pyarrow",
        # Each actor runs max_concurrent_batches calls (batches) at once, all on its one engine.
        "compute": ActorPoolStrategy(
            min_size=low, max_size=high, max_concurrent_calls_per_actor=config.max_concurrent_batches
        ),
        "num_cpus": ACTOR_CPUS,
        "udf_modifying_row_count": False,
    }
    if config.runtime_env is not None:
        kwargs["runtime_env"] = config.runtime_env
    return kwargs


def check_placeable(bundles: list[dict[str, float]], actors: int) -> None:
    """Raise at once if the cluster as it is can never hold `actors` engines and Ray Data's tasks and
    no autoscaler can add to it; on a cluster that may grow, warn and let the job wait for it."""
    import ray

    if not ray.is_initialized():
        return
    total = ray.cluster_resources()
    needs = pool_needs(bundles, actors)
    short = {r: n for r, n in needs.items() if n > total.get(r, 0.0)}
    if not short:
        return
    message = (
        f"tandem batch: {actors} actor(s) with rank bundles {bundles}, and Ray Data's tasks, need "
        + ", ".join(f"{n:g} {r}" for r, n in short.items())
        + f"; the cluster has {cluster_resources_summary()}"
    )
    if cluster_can_grow():
        logger.warning("%s, so the job waits for the autoscaler to add nodes", message)
        return
    raise PoolCannotBePlaced(
        f"{message}, and no autoscaler to add any: lower concurrency, tp_size or cpus_per_rank, or start "
        "Ray with more logical CPUs (ray.init(num_cpus=...)) when the rank actors mostly wait on GPUs"
    )
