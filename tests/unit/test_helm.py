"""The KubeRay Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, offline).

The rendered serveConfigV2 must be a valid Serve config whose args the project's own `AppArgs` schema
accepts, and the RayCluster must give each worker pod exactly one tensor-parallel group of GPUs.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from tandem.deploy.args import AppArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART_DIR = os.path.join(REPO, "helm", "tandem")
RAYSERVICE = "tandem/templates/rayservice.yaml"
IMPORT_PATH = "tandem.deploy.app:build_app"
HEAD_PORTS = {6379, 8265, 10001, 8000, 8080}


def _base(**overrides: Any) -> dict[str, Any]:
    """The keys outside callers always set, plus overrides."""
    values: dict[str, Any] = {
        "model": "Qwen/Qwen3-8B",
        "tensorParallelSize": 2,
        "replicas": 3,
        "image": {"repository": "registry.example/tandem", "tag": "0.1.0"},
    }
    values.update(overrides)
    return values


VALUE_SETS: dict[str, dict[str, Any]] = {
    "minimal-tp1": _base(tensorParallelSize=1, replicas=1),
    "tp2-three-replicas": _base(),
    "tp8-autoscaling": _base(
        tensorParallelSize=8, autoscaling={"minReplicas": 1, "maxReplicas": 4, "targetOngoingRequests": 16}
    ),
    "scale-to-zero": _base(tensorParallelSize=4, autoscaling={"minReplicas": 0, "maxReplicas": 2}),
    "everything": _base(
        tensorParallelSize=4,
        servedModelName="qwen",
        engine={"dtype": "bfloat16", "pageSize": 16, "chunkSize": 4096, "maxModelLen": 32768},
        serve={"maxOngoingRequests": 128, "maxQueuedRequests": -1, "cpusPerRank": 1.5},
        worker={
            "acceleratorType": "H100",
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        head={"nodeSelector": {"pool": "cpu"}},
        hfToken={"existingSecret": "hf-token", "secretKey": "token"},
        modelCache={"type": "pvc"},
        gcsFaultTolerance={
            "enabled": True,
            "redisAddress": "redis.ml.svc:6379",
            "redisPasswordSecret": {"name": "redis-password", "key": "password"},
        },
        upgradeStrategy={"type": "NewCluster"},
        metrics={"prometheusAnnotations": True},
    ),
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def _render(chart: helm.Chart, values: dict[str, Any], name: str = "llm") -> dict[str, list[dict[str, Any]]]:
    """Rendered manifests as parsed documents, by template path (empty templates dropped)."""
    out = chart.render(copy.deepcopy(values), name=name, namespace="ml")
    docs: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        parsed = [doc for doc in yaml.safe_load_all(text) if doc]
        if parsed:
            docs[path] = parsed
    return docs


def _rayservice(chart: helm.Chart, values: dict[str, Any]) -> dict[str, Any]:
    docs = _render(chart, values)[RAYSERVICE]
    assert len(docs) == 1
    return docs[0]


def _serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    text = rayservice["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 must be a YAML string"
    config = yaml.safe_load(text)
    assert isinstance(config, dict)
    return config


def _app_args(rayservice: dict[str, Any]) -> dict[str, Any]:
    (app,) = _serve_config(rayservice)["applications"]
    args = app["args"]
    assert isinstance(args, dict)
    return args


def _containers(rayservice: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    workers = [c for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    return head, workers


# ---------------------------------------------------------------------------------------------------
# Lint


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean_in_strict_mode(values: dict[str, Any]) -> None:
    report = helm.lint(CHART_DIR, values=copy.deepcopy(values), strict=True)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_without_a_model_reports_it() -> None:
    """The model has no default on purpose, so linting bare defaults names the missing key."""
    report = helm.lint(CHART_DIR, strict=True)
    assert any("model" in error for error in report["errors"])


# ---------------------------------------------------------------------------------------------------
# serveConfigV2


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_serve_config_is_accepted_by_app_args(chart: helm.Chart, values: dict[str, Any]) -> None:
    rayservice = _rayservice(chart, values)
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    config = _serve_config(rayservice)
    assert config["http_options"]["port"] == 8000
    (app,) = config["applications"]
    assert app["import_path"] == IMPORT_PATH
    assert app["route_prefix"] == "/"

    args = AppArgs.model_validate(app["args"])
    assert args.model == values["model"]
    assert args.tp_size == values["tensorParallelSize"]
    assert args.device == "cuda"
    if "autoscaling" in values:
        assert args.num_replicas is None
        assert args.autoscaling_config is not None
        assert args.autoscaling_config.min_replicas == values["autoscaling"]["minReplicas"]
        assert args.autoscaling_config.max_replicas == values["autoscaling"]["maxReplicas"]
    else:
        assert args.num_replicas == values["replicas"]
        assert args.autoscaling_config is None


def test_serve_config_carries_every_option(chart: helm.Chart) -> None:
    args = AppArgs.model_validate(_app_args(_rayservice(chart, VALUE_SETS["everything"])))
    assert args.resolved_served_model_name() == "qwen"
    assert args.engine.to_llm_kwargs() == {
        "dtype": "bfloat16",
        "page_size": 16,
        "chunk_size": 4096,
        "prefix_cache": True,
        "overlap": True,
        "cuda_graph": True,
        "seed": 0,
        "mem_fraction": 0.85,
        "max_model_len": 32768,
    }
    assert args.max_ongoing_requests == 128
    assert args.max_queued_requests == -1
    assert args.cpus_per_rank == 1.5
    assert args.placement_strategy == "STRICT_PACK"
    assert args.accelerator_type == "H100"


def test_unset_engine_options_are_left_out(chart: helm.Chart) -> None:
    engine = _app_args(_rayservice(chart, VALUE_SETS["minimal-tp1"]))["engine"]
    for unset in ("page_size", "chunk_size", "max_running", "max_model_len"):
        assert unset not in engine
    assert "served_model_name" not in _app_args(_rayservice(chart, VALUE_SETS["minimal-tp1"]))


# Values key paths for each AppArgs field the chart sets (device is always "cuda").
_TOP_LEVEL = {"model": "model", "served_model_name": "servedModelName", "tp_size": "tensorParallelSize"}
_SERVE = {
    "max_ongoing_requests": "maxOngoingRequests",
    "max_queued_requests": "maxQueuedRequests",
    "placement_strategy": "placementStrategy",
    "cpus_per_rank": "cpusPerRank",
}
_ENGINE = {
    "dtype": "dtype",
    "page_size": "pageSize",
    "chunk_size": "chunkSize",
    "prefix_cache": "prefixCache",
    "overlap": "overlap",
    "cuda_graph": "cudaGraph",
    "max_running": "maxRunning",
    "seed": "seed",
    "mem_fraction": "memFraction",
    "max_model_len": "maxModelLen",
}
_AUTOSCALING = {
    "min_replicas": "minReplicas",
    "max_replicas": "maxReplicas",
    "initial_replicas": "initialReplicas",
    "target_ongoing_requests": "targetOngoingRequests",
    "upscale_delay_s": "upscaleDelaySeconds",
    "downscale_delay_s": "downscaleDelaySeconds",
}


def _values_for(args: AppArgs) -> dict[str, Any]:
    """Chart values that express `args`; fails on any field the chart has no key for."""
    values = _base()
    given = args.model_dump(exclude_none=True)
    for field, key in _TOP_LEVEL.items():
        if field in given:
            values[key] = given.pop(field)
    values["serve"] = {key: given.pop(field) for field, key in _SERVE.items()}
    values["engine"] = {
        key: value
        for field, key in _ENGINE.items()
        if (value := given["engine"].pop(field, None)) is not None
    }
    assert given.pop("engine") == {}
    if "num_replicas" in given:
        values["replicas"] = given.pop("num_replicas")
    if "autoscaling_config" in given:
        scaling = given.pop("autoscaling_config")
        values["autoscaling"] = {
            key: scaling.pop(field) for field, key in _AUTOSCALING.items() if field in scaling
        }
        assert scaling == {}
    if "accelerator_type" in given:
        values["worker"] = {"acceleratorType": given.pop("accelerator_type")}
    given.pop("device")
    assert given == {}, f"AppArgs fields the chart cannot set: {sorted(given)}"
    return values


def _example_args() -> list[tuple[str, dict[str, Any]]]:
    examples: list[tuple[str, dict[str, Any]]] = [
        (
            "every-field",
            {
                "model": "meta-llama/Llama-3.1-70B-Instruct",
                "served_model_name": "llama-70b",
                "tp_size": 8,
                "device": "cuda",
                "engine": {
                    "dtype": "bfloat16",
                    "page_size": 32,
                    "chunk_size": 8192,
                    "prefix_cache": False,
                    "overlap": False,
                    "cuda_graph": False,
                    "max_running": 256,
                    "seed": 3,
                    "mem_fraction": 0.8,
                    "max_model_len": 65536,
                },
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": 6,
                    "initial_replicas": 2,
                    "target_ongoing_requests": 24,
                    "upscale_delay_s": 15,
                    "downscale_delay_s": 300,
                },
                "max_ongoing_requests": 96,
                "max_queued_requests": 512,
                "placement_strategy": "PACK",
                "cpus_per_rank": 2,
                "accelerator_type": "A100",
            },
        ),
        ("fixed-replicas", {"model": "Qwen/Qwen3-0.6B", "num_replicas": 2, "tp_size": 1}),
    ]
    # The example serve configs shipped with the project, where they name a model (the chart needs one).
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "configs", "*.yaml"))):
        with open(path) as handle:
            config = yaml.safe_load(handle) or {}
        for app in config.get("applications", []):
            if app.get("import_path") == IMPORT_PATH and (app.get("args") or {}).get("model"):
                examples.append((f"{os.path.basename(path)}:{app.get('name')}", app["args"]))
    return examples


_EXAMPLES = _example_args()


@pytest.mark.parametrize("args", [a for _, a in _EXAMPLES], ids=[n for n, _ in _EXAMPLES])
def test_chart_expresses_serve_config_args(chart: helm.Chart, args: dict[str, Any]) -> None:
    """Same meaning as a `serve run` config: args -> chart values -> rendered args round-trips."""
    expected = AppArgs.model_validate(args).model_copy(update={"device": "cuda"})
    if expected.num_replicas is None and expected.autoscaling_config is None:
        expected = expected.model_copy(update={"num_replicas": 1})
    values = _values_for(expected)
    rendered = AppArgs.model_validate(_app_args(_rayservice(chart, values)))
    assert rendered == expected


# ---------------------------------------------------------------------------------------------------
# rayClusterConfig


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_gpu_limits_equal_tensor_parallel_size(chart: helm.Chart, values: dict[str, Any]) -> None:
    rayservice = _rayservice(chart, values)
    head, workers = _containers(rayservice)
    assert workers, "at least one GPU worker group"
    tp = values["tensorParallelSize"]
    for container in workers:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in head["resources"].get("requests", {})


def test_gpu_count_cannot_be_overridden_by_worker_resources(chart: helm.Chart) -> None:
    values = _base(
        tensorParallelSize=4,
        worker={
            "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "20"}, "requests": {"nvidia.com/gpu": 1}}
        },
    )
    _, (worker,) = _containers(_rayservice(chart, values))
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["limits"]["cpu"] == "20"


def test_worker_cpu_and_memory_scale_with_tp(chart: helm.Chart) -> None:
    _, (worker,) = _containers(_rayservice(chart, _base(tensorParallelSize=8, worker={"cpusPerGpu": 3})))
    assert worker["resources"]["limits"]["cpu"] == "24"
    assert worker["resources"]["limits"]["memory"] == "256Gi"
    assert worker["resources"]["requests"] == worker["resources"]["limits"]


def test_head_has_no_gpus_and_all_ports(chart: helm.Chart) -> None:
    rayservice = _rayservice(chart, VALUE_SETS["tp2-three-replicas"])
    head_group = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head_group["rayStartParams"]["num-gpus"] == "0"
    assert head_group["rayStartParams"]["metrics-export-port"] == "8080"
    assert all(isinstance(v, str) for v in head_group["rayStartParams"].values())
    head, _ = _containers(rayservice)
    assert {port["containerPort"] for port in head["ports"]} == HEAD_PORTS
    assert head["image"] == "registry.example/tandem:0.1.0"


def test_head_num_gpus_stays_zero_when_overridden(chart: helm.Chart) -> None:
    values = _base(head={"rayStartParams": {"num-gpus": "1", "num-cpus": 0}})
    params = _rayservice(chart, values)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert params["num-gpus"] == "0"
    assert params["num-cpus"] == "0"


def test_fixed_replicas_size_the_worker_group(chart: helm.Chart) -> None:
    cluster = _rayservice(chart, _base(replicas=5))["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (5, 5, 5)
    assert group["rayStartParams"]["metrics-export-port"] == "8080"
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster


def test_autoscaling_bounds_replace_replicas(chart: helm.Chart) -> None:
    values = _base(replicas=7, autoscaling={"minReplicas": 1, "maxReplicas": 4, "initialReplicas": 2})
    rayservice = _rayservice(chart, values)
    cluster = rayservice["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 4)
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    args = _app_args(rayservice)
    assert "num_replicas" not in args
    assert args["autoscaling_config"]["initial_replicas"] == 2


def test_worker_placement_options(chart: helm.Chart) -> None:
    rayservice = _rayservice(chart, VALUE_SETS["everything"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    worker_pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert worker_pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert worker_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert cluster["headGroupSpec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert _app_args(rayservice)["accelerator_type"] == "H100"


def test_gcs_fault_tolerance(chart: helm.Chart) -> None:
    plain = _rayservice(chart, VALUE_SETS["tp2-three-replicas"])["spec"]["rayClusterConfig"]
    assert "gcsFaultToleranceOptions" not in plain
    options = _rayservice(chart, VALUE_SETS["everything"])["spec"]["rayClusterConfig"][
        "gcsFaultToleranceOptions"
    ]
    assert options["redisAddress"] == "redis.ml.svc:6379"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-password",
        "key": "password",
    }


def test_upgrade_strategy(chart: helm.Chart) -> None:
    default = _rayservice(chart, VALUE_SETS["minimal-tp1"])["spec"]
    assert default["upgradeStrategy"] == {"type": "NewCluster"}
    off = _rayservice(chart, _base(upgradeStrategy={"type": "None"}))["spec"]
    assert off["upgradeStrategy"] == {"type": "None"}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item for item in container.get("env", [])}


def test_hub_token_from_an_existing_secret(chart: helm.Chart) -> None:
    docs = _render(chart, VALUE_SETS["everything"])
    assert not any(doc["kind"] == "Secret" for docs_ in docs.values() for doc in docs_)
    head, workers = _containers(docs[RAYSERVICE][0])
    for container in [head, *workers]:
        ref = _env(container)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "hf-token", "key": "token"}


def test_hub_token_secret_created_from_a_value(chart: helm.Chart) -> None:
    docs = _render(chart, _base(hfToken={"value": "hf_abc"}))
    (secret,) = docs["tandem/templates/secret-hf-token.yaml"]
    assert secret["kind"] == "Secret"
    assert secret["stringData"] == {"HF_TOKEN": "hf_abc"}
    _, (worker,) = _containers(docs[RAYSERVICE][0])
    assert _env(worker)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_no_hub_token_by_default(chart: helm.Chart) -> None:
    head, workers = _containers(_rayservice(chart, VALUE_SETS["minimal-tp1"]))
    for container in [head, *workers]:
        assert "HF_TOKEN" not in _env(container)


def _pod_specs(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]
    ]


@pytest.mark.parametrize(
    ("cache", "expected_volume"),
    [
        ({"type": "pvc"}, {"persistentVolumeClaim": {"claimName": "llm-tandem-model-cache"}}),
        (
            {"type": "pvc", "pvc": {"existingClaim": "weights"}},
            {"persistentVolumeClaim": {"claimName": "weights"}},
        ),
        (
            {"type": "hostPath", "hostPath": {"path": "/mnt/models"}},
            {"hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}},
        ),
    ],
)
def test_model_cache(chart: helm.Chart, cache: dict[str, Any], expected_volume: dict[str, Any]) -> None:
    docs = _render(chart, _base(modelCache=dict(cache, mountPath="/cache")))
    for pod in _pod_specs(docs[RAYSERVICE][0]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert {k: v for k, v in volumes["model-cache"].items() if k != "name"} == expected_volume
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["model-cache"] == "/cache"
        assert mounts["dshm"] == "/dev/shm"
        assert _env(container)["HF_HOME"]["value"] == "/cache"
    pvcs = docs.get("tandem/templates/pvc-model-cache.yaml", [])
    creates_claim = cache["type"] == "pvc" and not cache.get("pvc", {}).get("existingClaim")
    assert len(pvcs) == (1 if creates_claim else 0)
    if creates_claim:
        assert pvcs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvcs[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_no_model_cache_by_default(chart: helm.Chart) -> None:
    docs = _render(chart, VALUE_SETS["minimal-tp1"])
    assert "tandem/templates/pvc-model-cache.yaml" not in docs
    for pod in _pod_specs(docs[RAYSERVICE][0]):
        assert [v["name"] for v in pod["volumes"]] == ["dshm"]


def test_prometheus_annotations(chart: helm.Chart) -> None:
    on = _rayservice(chart, VALUE_SETS["everything"])["spec"]["rayClusterConfig"]
    for group in [on["headGroupSpec"], *on["workerGroupSpecs"]]:
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "8080"
    off = _rayservice(chart, VALUE_SETS["minimal-tp1"])["spec"]["rayClusterConfig"]
    assert "annotations" not in off["headGroupSpec"]["template"]["metadata"]


def test_notes_explain_how_to_send_a_request(chart: helm.Chart) -> None:
    notes = chart.render(VALUE_SETS["everything"], name="llm", namespace="ml")["tandem/templates/NOTES.txt"]
    assert "port-forward svc/llm-tandem-serve-svc 8000:8000" in notes
    assert "/v1/chat/completions" in notes
    assert '"model": "qwen"' in notes


# ---------------------------------------------------------------------------------------------------
# values.schema.json and template checks


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensorParallelSize": 0}, "'/tensorParallelSize': minimum: got 0, want 1"),
        ({"model": None}, "missing property 'model'"),
        ({"replicas": -1}, "'/replicas': minimum: got -1, want 1"),
        ({"model": ""}, "'/model': minLength"),
        ({"tensorParallelSize": "2"}, "'/tensorParallelSize': got string, want integer"),
        ({"autoscaling": {"minReplicas": 1}}, "'maxReplicas' required"),
        ({"autoscaling": {"minReplicas": -1, "maxReplicas": 2}}, "'/autoscaling/minReplicas': minimum"),
        ({"engine": {"memFraction": 1.5}}, "'/engine/memFraction'"),
        ({"engine": {"dtype": "fp8"}}, "'/engine/dtype'"),
        ({"serve": {"placementStrategy": "SCATTER"}}, "'/serve/placementStrategy'"),
        ({"tensorParalelSize": 2}, "additional properties 'tensorParalelSize' not allowed"),
        ({"gcsFaultTolerance": {"enabled": True}}, "'/gcsFaultTolerance/redisAddress': minLength"),
        ({"modelCache": {"type": "nfs"}}, "'/modelCache/type'"),
    ],
)
def test_schema_rejects_bad_values(chart: helm.Chart, change: dict[str, Any], message: str) -> None:
    values = _base(**change)
    if values.get("model", "") is None:
        del values["model"]  # a missing model, not a null one
    with pytest.raises(helm.HelmValuesError) as direct:
        chart.validate_schema(copy.deepcopy(values))
    assert message in str(direct.value)
    with pytest.raises(helm.HelmValuesError) as rendering:
        chart.render(copy.deepcopy(values), name="llm")
    assert message in str(rendering.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
            "autoscaling.minReplicas (4) must be <= autoscaling.maxReplicas (2)",
        ),
        (
            {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "initialReplicas": 3}},
            "autoscaling.initialReplicas (3) must lie between",
        ),
        (
            {"tensorParallelSize": 4, "worker": {"resources": {"limits": {"cpu": "4500m"}}}},
            "worker CPU limit (4500m) is below what one replica reserves",
        ),
    ],
)
def test_template_rejects_inconsistent_values(
    chart: helm.Chart, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(_base(**change), name="llm")


def test_schema_is_valid_json_with_descriptions() -> None:
    with open(os.path.join(CHART_DIR, "values.schema.json")) as handle:
        schema = json.load(handle)
    assert set(schema["required"]) >= {"model", "tensorParallelSize", "replicas", "image"}
    for key, prop in schema["properties"].items():
        assert prop.get("description"), f"values key {key} has no description"


def test_chart_metadata(chart: helm.Chart) -> None:
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.name == "tandem"
    assert chart.schema is not None
    assert "model" not in chart.values, "the model must have no default, so a missing one is rejected"
