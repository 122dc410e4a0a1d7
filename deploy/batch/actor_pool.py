"""How an engine stage runs on Ray Data: an actor pool, one engine per actor, whose rank actors sit one
per bundle of a placement group the actor reserves (`actor_group.py`), through the serving replicas'
`RankGroup`.

Ray Data keeps its defaults for faults: an actor that dies is restarted and the batches it held are run
again there, so a crash loses no row and, since a batch's output is committed only when it is done,
duplicates none.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.data import ActorPoolStrategy

from tandem.cluster.ray_cluster import cluster_resources_summary
from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.host import EngineSpec
from tandem.deploy.protocol.templates import load_chat_template

logger = logging.getLogger(__name__)
ACTOR_CPUS = 1.0  # the stage actor itself: tokenizing, detokenizing, Arrow in and out
DATA_TASK_CPUS = 1.0  # Ray Data's own tasks beside the actors


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
    _warn_if_unplaceable(spec.bundles(), low)
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


def _warn_if_unplaceable(bundles: list[dict[str, float]], actors: int) -> None:
    import ray

    if not ray.is_initialized():
        return
    total = ray.cluster_resources()
    for resource in ("CPU", "GPU"):
        # Ray Data's own tasks (reading, repartitioning, pre- and postprocess) need a CPU beside them.
        own = ACTOR_CPUS + DATA_TASK_CPUS / actors if resource == "CPU" else 0.0
        need = actors * (own + sum(b.get(resource, 0.0) for b in bundles))
        if need > total.get(resource, 0.0):
            logger.warning(
                "tandem batch: %d actor(s) with rank bundles %s, and Ray Data's tasks, need %g %s; the "
                "cluster has %s, so the job waits until it grows (start Ray with more logical CPUs, "
                "e.g. ray.init(num_cpus=...), if the rank actors mostly wait on GPUs)",
                actors,
                bundles,
                need,
                resource,
                cluster_resources_summary(),
            )
