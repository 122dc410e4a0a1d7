"""The chart's hardening, rendered by the real Helm engine: non-root locked-down containers, probes on
/health, a NetworkPolicy around Ray's ports, the API key from a Secret, room for downloaded weights."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import pytest

NETWORK_POLICY = "tandem/templates/networkpolicy.yaml"
API_KEY_SECRET = "tandem/templates/secret-api-key.yaml"


def test_every_container_is_locked_down(
    chart: helm.Chart, helm_kit: Any, helm_values: dict[str, Any]
) -> None:
    rayservice = helm_kit.rayservice(chart, helm_values)
    head, workers = helm_kit.containers(rayservice)
    for container in [head, *workers]:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert context["seccompProfile"]["type"] == "RuntimeDefault"
    for pod in helm_kit.pod_specs(rayservice):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    autoscaler = rayservice["spec"]["rayClusterConfig"].get("autoscalerOptions")
    if autoscaler is not None:  # KubeRay's sidecar gets the same context
        assert autoscaler["securityContext"]["allowPrivilegeEscalation"] is False


def test_worker_probes_call_health_on_serve(chart: helm.Chart, helm_kit: Any) -> None:
    head, workers = helm_kit.containers(helm_kit.rayservice(chart, helm_kit.VALUE_SETS["tp2-three-replicas"]))
    # KubeRay deploys the app once the head is ready: the head keeps KubeRay's own probes.
    assert "readinessProbe" not in head and "livenessProbe" not in head
    for container in workers:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}
        # Liveness restarts a container only after a long outage; startup covers a long model load.
        live, ready = container["livenessProbe"], container["readinessProbe"]
        assert (
            live["periodSeconds"] * live["failureThreshold"]
            > ready["periodSeconds"] * ready["failureThreshold"]
        )
        start = container["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 3600
    off = helm_kit.base(probes={"enabled": False})
    _, workers = helm_kit.containers(helm_kit.rayservice(chart, off))
    assert "livenessProbe" not in workers[0] and "readinessProbe" not in workers[0]


def test_network_policy_keeps_ray_ports_to_the_clusters_own_pods(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.VALUE_SETS["tp2-three-replicas"])
    (policy,) = docs[NETWORK_POLICY]
    assert policy["kind"] == "NetworkPolicy"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "llm"}
    rules = policy["spec"]["ingress"]
    own, serve, metrics, operator = rules
    assert "ports" not in own and own["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert [p["port"] for p in serve["ports"]] == [8000] and "from" not in serve  # clients: anyone
    assert [p["port"] for p in metrics["ports"]] == [8080]
    assert {p["port"] for p in operator["ports"]} == {8265, 52365}
    assert operator["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    # No rule opens the GCS, the dashboard or the Ray client to everyone.
    for rule in rules:
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports & {6379, 8265, 10001}:
            assert rule.get("from"), rule
    # The pods carry the labels the policy selects.
    rayservice = docs["tandem/templates/rayservice.yaml"][0]
    cluster = rayservice["spec"]["rayClusterConfig"]
    for template in [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]:
        assert selector.items() <= template["metadata"]["labels"].items()
    limited = helm_kit.base(
        networkPolicy={"clients": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}
    )
    (policy,) = helm_kit.render(chart, limited)[NETWORK_POLICY]
    assert policy["spec"]["ingress"][1]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    assert NETWORK_POLICY not in helm_kit.render(chart, helm_kit.base(networkPolicy={"enabled": False}))


def test_dashboard_is_not_exposed(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.VALUE_SETS["everything"])
    kinds = [doc["kind"] for documents in docs.values() for doc in documents]
    assert "Service" not in kinds and "Ingress" not in kinds  # only KubeRay's ClusterIP services
    rayservice = docs["tandem/templates/rayservice.yaml"][0]
    head_group = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert "serviceType" not in head_group and "headService" not in head_group


@pytest.mark.parametrize(
    ("api_key", "secret_name", "secret_key"),
    [
        ({"existingSecret": "llm-keys", "secretKey": "keys"}, "llm-keys", "keys"),
        ({"value": "sk-a,sk-b"}, "llm-tandem-api-key", "TANDEM_API_KEY"),
    ],
)
def test_api_key_comes_from_a_secret(
    chart: helm.Chart, helm_kit: Any, api_key: dict[str, str], secret_name: str, secret_key: str
) -> None:
    docs = helm_kit.render(chart, helm_kit.base(apiKey=api_key))
    rayservice = docs["tandem/templates/rayservice.yaml"][0]
    head, workers = helm_kit.containers(rayservice)
    for container in [head, *workers]:
        env = helm_kit.env(container)["TANDEM_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": secret_key}
    assert "sk-a" not in rayservice["spec"]["serveConfigV2"]  # never in the spec the dashboard shows
    if "value" in api_key:
        (secret,) = docs[API_KEY_SECRET]
        assert secret["metadata"]["name"] == secret_name and secret["stringData"] == {secret_key: "sk-a,sk-b"}
    else:
        assert API_KEY_SECRET not in docs


def test_no_api_key_by_default(chart: helm.Chart, helm_kit: Any) -> None:
    docs = helm_kit.render(chart, helm_kit.base())
    head, _ = helm_kit.containers(docs["tandem/templates/rayservice.yaml"][0])
    assert "TANDEM_API_KEY" not in helm_kit.env(head) and API_KEY_SECRET not in docs


def test_ephemeral_storage_is_requested_for_weights(chart: helm.Chart, helm_kit: Any) -> None:
    head, workers = helm_kit.containers(helm_kit.rayservice(chart, helm_kit.base()))
    assert head["resources"]["requests"]["ephemeral-storage"] == "10Gi"
    assert all(w["resources"]["requests"]["ephemeral-storage"] == "100Gi" for w in workers)
    bigger = helm_kit.base(worker={"ephemeralStorage": "500Gi"})
    _, workers = helm_kit.containers(helm_kit.rayservice(chart, bigger))
    assert workers[0]["resources"]["requests"]["ephemeral-storage"] == "500Gi"


def test_lint_is_clean_with_every_hardening_option(helm_kit: Any) -> None:
    values = copy.deepcopy(helm_kit.VALUE_SETS["everything"])
    values["apiKey"] = {"value": "sk-a"}
    values["networkPolicy"] = {"clients": [{"podSelector": {"matchLabels": {"role": "gateway"}}}]}
    values["serve"]["chatTemplate"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    report = helm.lint(helm_kit.CHART_DIR, values=values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
