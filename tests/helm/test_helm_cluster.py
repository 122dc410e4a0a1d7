"""The KubeRay Helm chart's RayCluster, rendered by the real Helm engine (helm-python-sdk, offline): each
worker pod gets exactly one tensor-parallel group of GPUs; secrets, the model cache, metrics annotations
and NOTES; and the values schema and template checks that reject bad values.

The chart, its value sets and the render helpers come from tests/helm/conftest.py (`chart`, `helm_kit`,
`helm_values`); the serveConfigV2 side is in test_helm_serve_config.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import helm_python as helm
import pytest

HEAD_PORTS = {6379, 8265, 10001, 8000, 8080}


# ---------------------------------------------------------------------------------------------------
# rayClusterConfig


def test_gpu_limits_equal_tensor_parallel_size(
    chart: helm.Chart, helm_kit: Any, helm_values: dict[str, Any]
) -> None:
    rayservice = helm_kit.rayservice(chart, helm_values)
    head, workers = helm_kit.containers(rayservice)
    assert workers, "at least one GPU worker group"
    tp = helm_values["tensorParallelSize"]
    for container in workers:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in head["resources"].get("requests", {})


def test_gpu_count_cannot_be_overridden_by_worker_resources(chart: helm.Chart, helm_kit: Any) -> None:
    values = helm_kit.base(
        tensorParallelSize=4,
        worker={
            "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "20"}, "requests": {"nvidia.com/gpu": 1}}
        },
    )
    _, (worker,) = helm_kit.containers(helm_kit.rayservice(chart, values))
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["limits"]["cpu"] == "20"


def test_worker_cpu_and_memory_scale_with_tp(chart: helm.Chart, helm_kit: Any) -> None:
    _, (worker,) = helm_kit.containers(
        helm_kit.rayservice(chart, helm_kit.base(tensorParallelSize=8, worker={"cpusPerGpu": 3}))
    )
    assert worker["resources"]["limits"]["cpu"] == "24"
    assert worker["resources"]["limits"]["memory"] == "256Gi"
    assert worker["resources"]["requests"] == worker["resources"]["limits"]


def test_head_has_no_gpus_and_all_ports(chart: helm.Chart, helm_kit: Any) -> None:
    rayservice = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["tp2-three-replicas"])
    head_group = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head_group["rayStartParams"]["num-gpus"] == "0"
    assert head_group["rayStartParams"]["metrics-export-port"] == "8080"
    assert all(isinstance(v, str) for v in head_group["rayStartParams"].values())
    head, _ = helm_kit.containers(rayservice)
    assert {port["containerPort"] for port in head["ports"]} == HEAD_PORTS
    assert head["image"] == "registry.example/tandem:0.1.0"


def test_head_num_gpus_stays_zero_when_overridden(chart: helm.Chart, helm_kit: Any) -> None:
    values = helm_kit.base(head={"rayStartParams": {"num-gpus": "1", "num-cpus": 0}})
    params = helm_kit.rayservice(chart, values)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert params["num-gpus"] == "0"
    assert params["num-cpus"] == "0"


def test_fixed_replicas_size_the_worker_group(chart: helm.Chart, helm_kit: Any) -> None:
    cluster = helm_kit.rayservice(chart, helm_kit.base(replicas=5))["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (5, 5, 5)
    assert group["rayStartParams"]["metrics-export-port"] == "8080"
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster


def test_autoscaling_bounds_replace_replicas(chart: helm.Chart, helm_kit: Any) -> None:
    values = helm_kit.base(replicas=7, autoscaling={"minReplicas": 1, "maxReplicas": 4, "initialReplicas": 2})
    rayservice = helm_kit.rayservice(chart, values)
    cluster = rayservice["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 4)
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    args = helm_kit.app_args(rayservice)
    assert "num_replicas" not in args
    assert args["autoscaling_config"]["initial_replicas"] == 2


def test_worker_placement_options(chart: helm.Chart, helm_kit: Any) -> None:
    rayservice = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["everything"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    worker_pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert worker_pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert worker_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert cluster["headGroupSpec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert helm_kit.app_args(rayservice)["accelerator_type"] == "H100"


def test_gcs_fault_tolerance(chart: helm.Chart, helm_kit: Any) -> None:
    plain = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["tp2-three-replicas"])["spec"]["rayClusterConfig"]
    assert "gcsFaultToleranceOptions" not in plain
    options = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["everything"])["spec"]["rayClusterConfig"][
        "gcsFaultToleranceOptions"
    ]
    assert options["redisAddress"] == "redis.ml.svc:6379"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-password",
        "key": "password",
    }


def test_upgrade_strategy(chart: helm.Chart, helm_kit: Any) -> None:
    default = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["minimal-tp1"])["spec"]
    assert default["upgradeStrategy"] == {"type": "NewCluster"}
    off = helm_kit.rayservice(chart, helm_kit.base(upgradeStrategy={"type": "None"}))["spec"]
    assert off["upgradeStrategy"] == {"type": "None"}


def test_hub_token_from_an_existing_secret(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.VALUE_SETS["everything"])
    assert not any(doc["kind"] == "Secret" for docs_ in docs.values() for doc in docs_)
    head, workers = helm_kit.containers(docs[helm_kit.RAYSERVICE][0])
    for container in [head, *workers]:
        ref = helm_kit.env(container)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "hf-token", "key": "token"}


def test_hub_token_secret_created_from_a_value(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.base(hfToken={"value": "hf_abc"}))
    (secret,) = docs["tandem/templates/secret-hf-token.yaml"]
    assert secret["kind"] == "Secret"
    assert secret["stringData"] == {"HF_TOKEN": "hf_abc"}
    _, (worker,) = helm_kit.containers(docs[helm_kit.RAYSERVICE][0])
    assert helm_kit.env(worker)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_no_hub_token_by_default(chart: helm.Chart, helm_kit: Any) -> None:
    head, workers = helm_kit.containers(helm_kit.rayservice(chart, helm_kit.VALUE_SETS["minimal-tp1"]))
    for container in [head, *workers]:
        assert "HF_TOKEN" not in helm_kit.env(container)


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
def test_model_cache(
    chart: helm.Chart, helm_kit: Any, cache: dict[str, Any], expected_volume: dict[str, Any]
) -> None:
    docs = helm_kit.render(chart, helm_kit.base(modelCache=dict(cache, mountPath="/cache")))
    for pod in helm_kit.pod_specs(docs[helm_kit.RAYSERVICE][0]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert {k: v for k, v in volumes["model-cache"].items() if k != "name"} == expected_volume
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["model-cache"] == "/cache"
        assert mounts["dshm"] == "/dev/shm"
        assert helm_kit.env(container)["HF_HOME"]["value"] == "/cache"
    pvcs = docs.get("tandem/templates/pvc-model-cache.yaml", [])
    creates_claim = cache["type"] == "pvc" and not cache.get("pvc", {}).get("existingClaim")
    assert len(pvcs) == (1 if creates_claim else 0)
    if creates_claim:
        assert pvcs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvcs[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_no_model_cache_by_default(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.VALUE_SETS["minimal-tp1"])
    assert "tandem/templates/pvc-model-cache.yaml" not in docs
    for pod in helm_kit.pod_specs(docs[helm_kit.RAYSERVICE][0]):
        assert [v["name"] for v in pod["volumes"]] == ["dshm"]


def test_prometheus_annotations(chart: helm.Chart, helm_kit: Any) -> None:
    on = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["everything"])["spec"]["rayClusterConfig"]
    for group in [on["headGroupSpec"], *on["workerGroupSpecs"]]:
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "8080"
    off = helm_kit.rayservice(chart, helm_kit.VALUE_SETS["minimal-tp1"])["spec"]["rayClusterConfig"]
    assert "annotations" not in off["headGroupSpec"]["template"]["metadata"]


def test_notes_explain_how_to_send_a_request(chart: helm.Chart, helm_kit: Any) -> None:
    notes = chart.render(helm_kit.VALUE_SETS["everything"], name="llm", namespace="ml")[
        "tandem/templates/NOTES.txt"
    ]
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
def test_schema_rejects_bad_values(
    chart: helm.Chart, helm_kit: Any, change: dict[str, Any], message: str
) -> None:
    values = helm_kit.base(**change)
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
    chart: helm.Chart, helm_kit: Any, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(helm_kit.base(**change), name="llm")


def test_schema_is_valid_json_with_descriptions(helm_kit: Any) -> None:
    with open(os.path.join(helm_kit.CHART_DIR, "values.schema.json")) as handle:
        schema = json.load(handle)
    assert set(schema["required"]) >= {"model", "tensorParallelSize", "replicas", "image"}
    for key, prop in schema["properties"].items():
        assert prop.get("description"), f"values key {key} has no description"


def test_chart_metadata(chart: helm.Chart) -> None:
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.name == "tandem"
    assert chart.schema is not None
    assert "model" not in chart.values, "the model must have no default, so a missing one is rejected"
