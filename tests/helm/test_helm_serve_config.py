"""The KubeRay Helm chart's serveConfigV2, rendered and linted by the real Helm engine (helm-python-sdk,
offline): the rendered config must be a valid Serve config whose args the project's own `AppArgs`
schema accepts, and every `AppArgs` field must be expressible as chart values.

The chart, its value sets and the render helpers come from tests/helm/conftest.py (`chart`, `helm_kit`,
`helm_values`); the RayCluster side is in test_helm_cluster.py.
"""

from __future__ import annotations

import copy
import glob
import os
from typing import Any

import helm_python as helm
import pytest
import yaml

from tandem.deploy.config.args import AppArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPORT_PATH = "tandem.deploy.app:build_app"


# ---------------------------------------------------------------------------------------------------
# Lint


def test_lint_is_clean_in_strict_mode(helm_values: dict[str, Any], helm_kit: Any) -> None:
    report = helm.lint(helm_kit.CHART_DIR, values=copy.deepcopy(helm_values), strict=True)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_without_a_model_reports_it(helm_kit: Any) -> None:
    """The model has no default on purpose, so linting bare defaults names the missing key."""
    report = helm.lint(helm_kit.CHART_DIR, strict=True)
    assert any("model" in error for error in report["errors"])


# ---------------------------------------------------------------------------------------------------
# serveConfigV2


def test_serve_config_is_accepted_by_app_args(
    chart: helm.Chart, helm_kit: Any, helm_values: dict[str, Any]
) -> None:
    rayservice = helm_kit.rayservice(chart, helm_values)
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    config = helm_kit.serve_config(rayservice)
    assert config["http_options"]["port"] == 8000
    (app,) = config["applications"]
    assert app["import_path"] == IMPORT_PATH
    assert app["route_prefix"] == "/"

    args = AppArgs.model_validate(app["args"])
    assert args.model == helm_values["model"]
    assert args.tp_size == helm_values["tensorParallelSize"]
    assert args.device == "cuda"
    if "autoscaling" in helm_values:
        assert args.num_replicas is None
        assert args.autoscaling_config is not None
        assert args.autoscaling_config.min_replicas == helm_values["autoscaling"]["minReplicas"]
        assert args.autoscaling_config.max_replicas == helm_values["autoscaling"]["maxReplicas"]
    else:
        assert args.num_replicas == helm_values["replicas"]
        assert args.autoscaling_config is None


def test_serve_config_carries_every_option(chart: helm.Chart, helm_kit: Any) -> None:
    args = AppArgs.model_validate(
        helm_kit.app_args(helm_kit.rayservice(chart, helm_kit.VALUE_SETS["everything"]))
    )
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


def test_unset_engine_options_are_left_out(chart: helm.Chart, helm_kit: Any) -> None:
    engine = helm_kit.app_args(helm_kit.rayservice(chart, helm_kit.VALUE_SETS["minimal-tp1"]))["engine"]
    for unset in ("page_size", "chunk_size", "max_running", "max_model_len"):
        assert unset not in engine
    assert "served_model_name" not in helm_kit.app_args(
        helm_kit.rayservice(chart, helm_kit.VALUE_SETS["minimal-tp1"])
    )


# Values key paths for each AppArgs field the chart sets (device is always "cuda").
_TOP_LEVEL = {"model": "model", "served_model_name": "servedModelName", "tp_size": "tensorParallelSize"}
_SERVE = {
    "max_ongoing_requests": "maxOngoingRequests",
    "max_queued_requests": "maxQueuedRequests",
    "placement_strategy": "placementStrategy",
    "cpus_per_rank": "cpusPerRank",
    "max_request_body_bytes": "maxRequestBodyBytes",
    "max_choices_per_request": "maxChoicesPerRequest",
    "prompt_chars_per_token": "promptCharsPerToken",
    "chat_template": "chatTemplate",
    "stuck_rank_timeout_s": "stuckRankTimeoutSeconds",
    "allowed_origins": "allowedOrigins",
    "enable_auto_tool_choice": "enableAutoToolChoice",
    "tool_call_parser": "toolCallParser",
    "reasoning_parser": "reasoningParser",
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


def _values_for(helm_kit: Any, args: AppArgs) -> dict[str, Any]:
    """Chart values that express `args`; fails on any field the chart has no key for."""
    values = helm_kit.base()
    given = args.model_dump(exclude_none=True)
    for field, key in _TOP_LEVEL.items():
        if field in given:
            values[key] = given.pop(field)
    values["serve"] = {key: given.pop(field) for field, key in _SERVE.items() if field in given}
    engine = args.engine.to_llm_kwargs()  # the options the config set
    values["engine"] = {
        key: value for field, key in _ENGINE.items() if (value := engine.pop(field, None)) is not None
    }
    assert engine == {}, f"engine options the chart cannot set: {sorted(engine)}"
    given.pop("engine")
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
                "max_request_body_bytes": 4 << 20,
                "max_choices_per_request": 64,
                "prompt_chars_per_token": 16,
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                "stuck_rank_timeout_s": 20,
                "allowed_origins": ["https://ui.example"],
                "enable_auto_tool_choice": False,
                "tool_call_parser": "hermes",
                "reasoning_parser": "qwen3",
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
def test_chart_expresses_serve_config_args(chart: helm.Chart, helm_kit: Any, args: dict[str, Any]) -> None:
    """Same meaning as a `serve run` config: args -> chart values -> rendered args round-trips."""
    expected = AppArgs.model_validate(args).model_copy(update={"device": "cuda"})
    if expected.num_replicas is None and expected.autoscaling_config is None:
        expected = expected.model_copy(update={"num_replicas": 1})
    values = _values_for(helm_kit, expected)
    rendered = AppArgs.model_validate(helm_kit.app_args(helm_kit.rayservice(chart, values)))
    assert rendered == expected
