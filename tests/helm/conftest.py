"""Fixtures of the deploy tests: the KubeRay Helm chart (helm/tandem) and its render helpers.

The test_helm_* modules render the chart with the real Helm engine (helm-python-sdk, offline) and reach
the helpers below through the `helm_kit` fixture, the value sets through `helm_values`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import helm_python as helm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART_DIR = os.path.join(REPO, "helm", "tandem")
RAYSERVICE = "tandem/templates/rayservice.yaml"


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


class HelmKit:
    """The chart's paths, its value sets and the helpers that render it into parsed manifests."""

    CHART_DIR = CHART_DIR
    RAYSERVICE = RAYSERVICE
    VALUE_SETS = VALUE_SETS
    base = staticmethod(_base)

    @staticmethod
    def render(
        chart: helm.Chart, values: dict[str, Any], name: str = "llm"
    ) -> dict[str, list[dict[str, Any]]]:
        """Rendered manifests as parsed documents, by template path (empty templates dropped)."""
        import yaml

        out = chart.render(copy.deepcopy(values), name=name, namespace="ml")
        docs: dict[str, list[dict[str, Any]]] = {}
        for path, text in out.items():
            if path.endswith("NOTES.txt"):
                continue
            parsed = [doc for doc in yaml.safe_load_all(text) if doc]
            if parsed:
                docs[path] = parsed
        return docs

    @staticmethod
    def rayservice(chart: helm.Chart, values: dict[str, Any]) -> dict[str, Any]:
        docs = HelmKit.render(chart, values)[RAYSERVICE]
        assert len(docs) == 1
        return docs[0]

    @staticmethod
    def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
        import yaml

        text = rayservice["spec"]["serveConfigV2"]
        assert isinstance(text, str), "serveConfigV2 must be a YAML string"
        config = yaml.safe_load(text)
        assert isinstance(config, dict)
        return config

    @staticmethod
    def app_args(rayservice: dict[str, Any]) -> dict[str, Any]:
        (app,) = HelmKit.serve_config(rayservice)["applications"]
        args = app["args"]
        assert isinstance(args, dict)
        return args

    @staticmethod
    def containers(rayservice: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        cluster = rayservice["spec"]["rayClusterConfig"]
        (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
        workers = [c for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
        return head, workers

    @staticmethod
    def env(container: dict[str, Any]) -> dict[str, Any]:
        return {item["name"]: item for item in container.get("env", [])}

    @staticmethod
    def pod_specs(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
        cluster = rayservice["spec"]["rayClusterConfig"]
        return [cluster["headGroupSpec"]["template"]["spec"]] + [
            group["template"]["spec"] for group in cluster["workerGroupSpecs"]
        ]


@pytest.fixture(scope="session")
def helm_kit() -> type[HelmKit]:
    return HelmKit


@pytest.fixture(params=list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def helm_values(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each of `VALUE_SETS` in turn, test ids by name: the chart must handle every one."""
    values: dict[str, Any] = request.param
    return values


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    """The chart, loaded once per test module."""
    import helm_python as helm  # here, not at the top: only the test_helm_* modules need the Helm engine

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
