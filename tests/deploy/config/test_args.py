"""The serve-app args schema: defaults, validation messages, and the LLM kwargs it produces."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tandem.deploy.config.args import TINY_MODEL_NAME, AppArgs, AutoscalingArgs, EngineArgs


def _error_text(args: dict[str, Any], model: type[BaseModel] = AppArgs) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(args)
    return str(info.value)


def test_defaults() -> None:
    args = AppArgs()
    assert args.model is None
    assert args.served_model_name is None
    assert args.tp_size == 1
    assert args.device == "auto"
    assert args.num_replicas is None
    assert args.autoscaling_config is None
    assert args.max_ongoing_requests is None  # the engine's capacity, known once it runs
    assert args.max_queued_requests is None
    assert args.placement_strategy == "STRICT_PACK"
    assert args.cpus_per_rank == 1.0
    assert args.accelerator_type is None
    engine = args.engine
    assert engine.dtype == "auto"
    assert (engine.prefix_cache, engine.overlap, engine.cuda_graph) == (True, True, True)
    assert engine.seed == 0
    assert engine.mem_fraction == 0.85
    assert engine.page_size is None and engine.chunk_size is None
    assert engine.max_running is None and engine.max_model_len is None


def test_engine_default_is_not_shared() -> None:
    first, second = AppArgs(), AppArgs()
    first.engine.seed = 7
    assert second.engine.seed == 0


def test_every_field_is_documented() -> None:
    for model in (AppArgs, EngineArgs, AutoscalingArgs):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize(
    ("served", "model", "expected"),
    [
        (None, None, TINY_MODEL_NAME),
        (None, "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
        ("qwen", "Qwen/Qwen3-0.6B", "qwen"),
        ("tiny", None, "tiny"),
    ],
)
def test_resolved_served_model_name(served: str | None, model: str | None, expected: str) -> None:
    args = AppArgs(served_model_name=served, model=model)
    assert args.resolved_served_model_name() == expected


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": "two"}, "tp_size"),
        ({"device": "tpu"}, "device"),
        ({"model": ""}, "model"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
        ({"max_queued_requests": -2}, "max_queued_requests"),
        ({"placement_strategy": "SCATTER"}, "placement_strategy"),
        ({"cpus_per_rank": 0}, "cpus_per_rank"),
        ({"engine": {"dtype": "float8"}}, "engine.dtype"),
        ({"engine": {"page_size": 0}}, "engine.page_size"),
        ({"engine": {"chunk_size": -1}}, "engine.chunk_size"),
        ({"engine": {"max_running": 0}}, "engine.max_running"),
        ({"engine": {"max_model_len": 0}}, "engine.max_model_len"),
        ({"engine": {"seed": -1}}, "engine.seed"),
        ({"engine": {"mem_fraction": 0.0}}, "engine.mem_fraction"),
        ({"engine": {"mem_fraction": 1.0}}, "engine.mem_fraction"),
        ({"autoscaling_config": {"min_replicas": -1}}, "autoscaling_config.min_replicas"),
        ({"autoscaling_config": {"max_replicas": 0}}, "autoscaling_config.max_replicas"),
        (
            {"autoscaling_config": {"target_ongoing_requests": 0}},
            "autoscaling_config.target_ongoing_requests",
        ),
    ],
)
def test_invalid_values_name_the_field(args: dict[str, Any], field: str) -> None:
    text = _error_text(args)
    assert field in text
    assert "1 validation error" in text


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"tp": 2}, "tp"),
        ({"engine": {"pagesize": 16}}, "engine.pagesize"),
        ({"autoscaling_config": {"min": 1}}, "autoscaling_config.min"),
    ],
)
def test_unknown_keys_are_rejected(args: dict[str, Any], field: str) -> None:
    text = _error_text(args)
    assert field in text
    assert "Extra inputs are not permitted" in text


def test_num_replicas_and_autoscaling_are_exclusive() -> None:
    text = _error_text({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    assert "num_replicas" in text and "autoscaling_config" in text
    assert "not both" in text
    # Each alone is fine.
    assert AppArgs(num_replicas=2).num_replicas == 2
    scaled = AppArgs.model_validate({"autoscaling_config": {"min_replicas": 0, "max_replicas": 4}})
    assert scaled.autoscaling_config is not None
    assert (scaled.autoscaling_config.min_replicas, scaled.autoscaling_config.max_replicas) == (0, 4)


def test_autoscaling_min_above_max_is_rejected() -> None:
    text = _error_text({"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}})
    assert "min_replicas (5)" in text and "max_replicas (2)" in text


def test_autoscaling_initial_replicas_within_bounds() -> None:
    text = _error_text({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 4}})
    assert "initial_replicas (4)" in text
    ok = AutoscalingArgs(min_replicas=1, max_replicas=3, initial_replicas=2)
    assert ok.to_serve_config() == {
        "min_replicas": 1,
        "max_replicas": 3,
        "initial_replicas": 2,
    }  # an unset target is derived by the app builder (test_prefix_routing.py)


def test_to_llm_kwargs_drops_unset_options() -> None:
    assert EngineArgs().to_llm_kwargs() == {}  # the engine's defaults, which are EngineArgs' own
    kwargs = EngineArgs(dtype="bfloat16", page_size=16, max_running=8, overlap=False).to_llm_kwargs()
    assert kwargs == {"dtype": "bfloat16", "page_size": 16, "max_running": 8, "overlap": False}


def test_engine_switches_reach_the_runtime_options() -> None:
    """Every engine switch a serve config may set is a keyword the rank runtime accepts."""
    from tandem.scheduler.runtime import RuntimeOptions

    switches = {
        "attention_backend": "torch",
        "piecewise_cuda_graph": False,
        "copy_stream": False,
        "fused_kernels": False,
        "cuda_graph_max_bs": 64,
        "piecewise_max_tokens": 1024,
    }
    kwargs = EngineArgs.model_validate(switches).to_llm_kwargs()
    assert {k: kwargs[k] for k in switches} == switches
    options = RuntimeOptions.of(**kwargs).flat()
    assert all(options[k] == v for k, v in switches.items())
    with pytest.raises(ValidationError):
        EngineArgs.model_validate({"cuda_graph_max_bs": 0})


def test_yaml_style_args_parse() -> None:
    """The shape a serve config's `args:` block has after YAML loading."""
    args = AppArgs.model_validate(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "served_model_name": "llama",
            "tp_size": 2,
            "device": "cuda",
            "engine": {"dtype": "bfloat16", "chunk_size": 2048, "mem_fraction": 0.9},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
            "max_ongoing_requests": 128,
            "max_queued_requests": -1,
            "placement_strategy": "PACK",
            "cpus_per_rank": 2,
            "accelerator_type": "H100",
        }
    )
    assert args.tp_size == 2
    assert args.engine.to_llm_kwargs()["chunk_size"] == 2048
    assert args.max_queued_requests == -1
    assert args.rank_bundle(use_gpu=True) == {"CPU": 2.0, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert args.rank_bundle(use_gpu=False) == {"CPU": 2.0}
