"""What a batch pool reserves, and what happens when a cluster cannot hold it: refused at once on a fixed
cluster, a warning and a wait on one an autoscaler may grow. Ray's resource calls are the edge faked here;
tests/e2e/test_batch_small_cluster.py runs both on a real Ray."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tandem.deploy.batch import actor_pool
from tandem.deploy.batch.config import ProcessorConfig


def _cluster(monkeypatch: Any, cpus: float, can_grow: bool) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": cpus})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": cpus})
    monkeypatch.setattr(actor_pool, "cluster_can_grow", lambda: can_grow)


def test_actors_reserve_a_sliver_and_a_started_ray_fits_the_pool() -> None:
    needs = actor_pool.pool_needs([{"CPU": 1.0}], actors=2)
    assert needs == {"CPU": 2 * (1.0 + actor_pool.ACTOR_CPUS) + 1.0, "GPU": 0.0}
    config = ProcessorConfig(model_source="m", concurrency=(1, 4))
    assert actor_pool.local_cluster_cpus(config) >= 4 * (1.0 + actor_pool.ACTOR_CPUS) + 1.0


def test_a_fixed_cluster_too_small_is_refused_naming_need_and_supply(monkeypatch: Any) -> None:
    _cluster(monkeypatch, cpus=2.0, can_grow=False)
    with pytest.raises(actor_pool.PoolCannotBePlaced) as refused:
        actor_pool.check_placeable([{"CPU": 1.0}], actors=4)
    assert "need 6 CPU" in str(refused.value) and "CPU: 2/2 free" in str(refused.value)
    actor_pool.check_placeable([{"CPU": 1.0}], actors=0)  # nothing to place: fine


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_cluster_that_may_grow_warns_and_waits(monkeypatch: Any) -> None:
    _cluster(monkeypatch, cpus=2.0, can_grow=True)
    # On the module's logger itself, not propagated: the root's handlers may carry Ray's filters, which
    # would ask the (faked) running Ray for its context.
    lines = _Lines()
    monkeypatch.setattr(actor_pool.logger, "propagate", False)
    actor_pool.logger.addHandler(lines)
    try:
        actor_pool.check_placeable([{"CPU": 1.0}], actors=4)
    finally:
        actor_pool.logger.removeHandler(lines)
    (line,) = lines.lines
    assert "need 6 CPU" in line and "waits for the autoscaler" in line
