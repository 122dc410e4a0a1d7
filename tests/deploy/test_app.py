"""The app builder's deployment options, the example configs, stats, metrics and the docs."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from ray.serve import Application

from tandem.deploy.app import (
    ADMISSION_SLACK,
    REPLICA_CPUS,
    build_app,
    llm_server_options,
    placement_bundles,
    resolve_device,
)
from tandem.deploy.config.args import AppArgs, AutoscalingArgs, EngineArgs
from tandem.deploy.config.capacity import engine_capacity_bound
from tandem.deploy.observability.metrics import METRIC_NAMES, ServingMetrics
from tandem.deploy.observability.stats import aggregate_stats
from tandem.deploy.serving.server import QUEUED_PER_RUNNING
from tandem.scheduler.runtime import MAX_RUNNING_CPU, MAX_RUNNING_GPU

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "deploy", "configs", "*.yaml")))


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as handle:
        return handle.read()


def _config_args(name: str) -> dict[str, Any]:
    (app,) = yaml.safe_load(_read("deploy", "configs", name))["applications"]
    return dict(app["args"])


def test_placement_merges_the_replica_cpu_into_bundle_0() -> None:
    args = AppArgs(model="m", tp_size=2, cpus_per_rank=1.5, accelerator_type="H100")
    bundles = placement_bundles(args, "cuda")
    assert bundles[0] == {"CPU": 1.5 + REPLICA_CPUS, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert bundles[1] == {"CPU": 1.5, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert placement_bundles(AppArgs(tp_size=3), "cpu") == [{"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 1.0}]


def test_llm_server_options_carry_the_user_settings() -> None:
    fixed = llm_server_options(AppArgs(max_ongoing_requests=7, max_queued_requests=9), "cpu")
    assert fixed["num_replicas"] == 1
    assert fixed["placement_group_strategy"] == "STRICT_PACK"
    assert fixed["ray_actor_options"] == {
        "num_cpus": REPLICA_CPUS,
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    }
    scaled = AppArgs(
        autoscaling_config=AutoscalingArgs(min_replicas=0, max_replicas=3), placement_strategy="PACK"
    )
    options = llm_server_options(scaled, "cuda")
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert options["placement_group_strategy"] == "PACK"
    # Unset, the bound follows the engine's capacity (unlike Ray Serve LLM's 1e9 default).
    assert llm_server_options(AppArgs(), "cpu")["max_ongoing_requests"] < 10_000


def test_default_admission_follows_the_engine_capacity() -> None:
    # Before the engine starts, Serve's bound comes from what the engine could run at once: its
    # max_running, else the largest decode graph on GPU; the replica then admits what it reports.
    cpu = llm_server_options(AppArgs(), "cpu")["max_ongoing_requests"]
    assert cpu == MAX_RUNNING_CPU * (1 + QUEUED_PER_RUNNING) + ADMISSION_SLACK
    assert engine_capacity_bound(AppArgs(model="m"), "cuda") == MAX_RUNNING_GPU
    graphs_64 = AppArgs(model="m", engine={"cuda_graph_max_bs": 64})
    assert engine_capacity_bound(graphs_64, "cuda") == 64
    no_graphs = AppArgs(model="m", engine={"cuda_graph": False, "cuda_graph_max_bs": 64})
    assert engine_capacity_bound(no_graphs, "cuda") == MAX_RUNNING_GPU
    assert engine_capacity_bound(AppArgs(engine={"max_running": 12}), "cuda") == 12


def test_serve_admits_what_the_replica_runs_or_queues_itself() -> None:
    # The replica applies max_ongoing/max_queued itself (Admission), so overload is its shaped 503;
    # Serve lets in that much plus slack and never queues at the proxy (whose 503 is plain text).
    one = llm_server_options(AppArgs(max_ongoing_requests=16, max_queued_requests=64), "cpu")
    assert one["max_ongoing_requests"] == 16 + 64 + ADMISSION_SLACK
    assert one["max_queued_requests"] == -1
    unbounded = llm_server_options(AppArgs(max_ongoing_requests=8, max_queued_requests=-1), "cpu")
    assert unbounded["max_ongoing_requests"] == 2 * 8 + ADMISSION_SLACK


def test_the_app_is_one_deployment_that_is_its_own_ingress() -> None:
    app = build_app(AppArgs())
    deployment = app._bound_deployment  # type: ignore[attr-defined]
    assert deployment.name == "LLMServer"
    # Unset bounds reach the replica as None: it sizes admission from its engine once that is up.
    assert deployment.init_kwargs["max_running"] is None and deployment.init_kwargs["max_queued"] is None
    assert not any(hasattr(arg, "deployment") for arg in deployment.init_args)  # no handle to a 2nd hop


def test_device_resolution() -> None:
    assert resolve_device(AppArgs()) == "cpu"  # the demo model runs on CPU
    assert resolve_device(AppArgs(model="m", device="cuda")) == "cuda"
    assert resolve_device(AppArgs(model="m", device="cpu")) == "cpu"


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_example_configs_build(path: str) -> None:
    (app,) = yaml.safe_load(_read(path))["applications"]
    assert app["import_path"] == "tandem.deploy.app:build_app"
    args = AppArgs.model_validate(app["args"])
    assert isinstance(build_app(args.model_copy(update={"device": "cpu"})), Application)


def test_the_example_configs_cover_the_documented_shapes() -> None:
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"cpu-tiny.yaml", "gpu-1.yaml", "tp2.yaml", "tp8-autoscaling.yaml"} <= names
    tp8 = AppArgs.model_validate(_config_args("tp8-autoscaling.yaml"))
    assert tp8.tp_size == 8 and tp8.autoscaling_config is not None
    assert "model" not in _config_args("cpu-tiny.yaml")


def test_docs_document_every_field() -> None:
    text = _read("docs", "serve-config.md")
    for model in (AppArgs, EngineArgs, AutoscalingArgs):
        for name in model.model_fields:
            assert f"`{name}`" in text, f"docs/serve-config.md does not document {model.__name__}.{name}"
    for metric in METRIC_NAMES:
        assert metric in text


def test_aggregate_stats() -> None:
    def replica(used: int, per_group: list[int], peak: list[int]) -> dict[str, Any]:
        return {
            "kv_pages_used": used,
            "kv_pages_used_per_group": per_group,
            "kv_pages_peak_per_group": peak,
            "kv_group_windows": [0, 4],
        }

    per_replica = [replica(2, [2, 1], [5, 1]), replica(3, [3, 0], [4, 2])]
    total = aggregate_stats(per_replica)
    assert total["kv_pages_used"] == 5 and total["kv_pages_used_per_group"] == [5, 1]
    assert total["kv_pages_peak_per_group"] == [5, 2] and total["kv_group_windows"] == [0, 4]
    assert total["num_replicas"] == 2
    assert "per_replica_prefix_cache" not in total  # these replicas report no prefix cache
    per_replica[1] |= {"prefix_cache_query_tokens": 40, "prefix_cache_hit_tokens": 16}
    assert aggregate_stats(per_replica)["per_replica_prefix_cache"] == [
        {"prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0},
        {"prefix_cache_query_tokens": 40, "prefix_cache_hit_tokens": 16},
    ]
    assert aggregate_stats([]) == {"num_replicas": 0}


class _Recorder:
    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name, self.values = name, []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.values.append(value)

    set = observe = inc


def test_serving_metrics_turn_cumulative_stats_into_increments(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.util import metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, _Recorder)
    recorder = ServingMetrics("tiny")
    assert sorted(m.name for m in vars(recorder).values() if isinstance(m, _Recorder)) == sorted(METRIC_NAMES)
    for hits in (0, 5, 5, 9, 2):  # 2 < 9: the replica restarted its counter
        recorder.engine_stats({"kv_pages_total": 10, "kv_pages_used": 4, "prefix_cache_hit_tokens": hits})
    assert recorder._prefix_hits.values == [5, 4]  # type: ignore[attr-defined]
    assert recorder._kv_usage.values[-1] == 0.4  # type: ignore[attr-defined]
    recorder.inter_token(0.3, 3)  # one delta of 3 tokens: one observation of its per-token gap
    assert recorder._itl.values == pytest.approx([0.1])  # type: ignore[attr-defined]
    recorder.generation_tokens(0)  # a Ray Counter rejects 0: nothing is recorded
    assert recorder._generation.values == []  # type: ignore[attr-defined]


def test_llm_server_shutdown_after_a_constructor_that_failed_part_way() -> None:
    """Serve calls `__del__` on a replica whose constructor raised after the LLMReplica existed (a rank
    that could not start): it still stops the ranks, with no drain, instead of raising AttributeError."""
    import asyncio

    from tandem.deploy.serving.server import LLMServer

    class Replica:
        drains: list[float] = []

        async def shutdown(self, drain_timeout_s: float) -> None:
            self.drains.append(drain_timeout_s)

    # Our class under Serve's ingress wrapper; called on a bare namespace, so no half-built instance is
    # left for the garbage collector to call the async __del__ on again.
    ours = LLMServer.func_or_class.__mro__[1]
    asyncio.run(ours.__del__(SimpleNamespace(_replica=Replica())))
    assert Replica.drains == [0.0]
