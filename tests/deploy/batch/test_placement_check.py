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


def test_a_cluster_that_may_grow_warns_and_waits(monkeypatch: Any, caplog: Any) -> None:
    _cluster(monkeypatch, cpus=2.0, can_grow=True)
    with caplog.at_level(logging.WARNING):
        actor_pool.check_placeable([{"CPU": 1.0}], actors=4)
    assert "need 6 CPU" in caplog.text and "waits for the autoscaler" in caplog.text
