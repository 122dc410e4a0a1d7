"""Engine options are declared once (engine/options.py, scheduler/options.py): the serve config's
`EngineArgs`, the `LLM` constructor and the dataclasses must agree on names, defaults and bounds."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.deploy.config.args import EngineArgs
from tandem.engine.options import EngineOptions, user_fields
from tandem.llm import LLM
from tandem.scheduler.options import RuntimeOptions


def _user_options() -> dict[str, Any]:
    """name -> default of every option a user may set."""
    return {name: f.default for cls in (RuntimeOptions, EngineOptions) for name, _hint, f in user_fields(cls)}


def test_engine_args_are_the_user_options() -> None:
    options = _user_options()
    assert list(EngineArgs.model_fields) == list(options)
    for name, default in options.items():
        field = EngineArgs.model_fields[name]
        assert field.default == default, name
        assert field.description, name


def test_every_option_is_documented_and_validated() -> None:
    for cls in (RuntimeOptions, EngineOptions):
        for f in dataclasses.fields(cls):
            if f.name != "engine":
                assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"


def test_llm_signature_agrees_with_the_options() -> None:
    """LLM's named parameters (ARCHITECTURE §6) are options with the same defaults; every other option
    reaches it through **engine_options."""
    params = inspect.signature(LLM.__init__).parameters
    flat = RuntimeOptions().flat()
    named = [p for p in params.values() if p.kind is p.KEYWORD_ONLY and p.name != "tp_size"]
    section6 = "device dtype page_size chunk_size prefix_cache overlap cuda_graph max_running seed"
    assert {p.name for p in named} == set(section6.split())
    for p in named:
        assert p.name in flat and p.default == flat[p.name], p.name
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name in set(flat) - {p.name for p in named}:
        RuntimeOptions.of(**{name: flat[name]})  # accepted as a keyword


def test_a_config_reaches_the_runtime_options_unchanged() -> None:
    given = {
        "dtype": "bfloat16",
        "attention_backend": "torch",
        "piecewise_cuda_graph": False,
        "fused_decode_max_bs": 16,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8_e4m3",
        "chunk_size": 512,
    }
    kwargs = EngineArgs.model_validate(given).to_llm_kwargs()
    assert kwargs == given
    options = RuntimeOptions.of(device="cpu", **kwargs)
    assert options.chunk_size == 512 and options.engine.quantization == "fp8"
    assert {k: v for k, v in options.flat().items() if k in given} == given


@pytest.mark.parametrize(
    "bad",
    [
        {"fused_decode_max_bs": 33},
        {"pdl_max_bs": -1},
        {"mem_fraction": 0.0},
        {"quantization": "int4"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"attention_backend": "triton"},
        {"seed": -1},
        {"num_pages": 0},
        {"load_format": "pt"},
    ],
)
def test_both_edges_reject_the_same_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        EngineArgs.model_validate(bad)
    with pytest.raises(ValueError):
        RuntimeOptions.of(**bad)


def test_vllm_names_are_declared_once_and_read_everywhere() -> None:
    """Each option's vLLM name lives in its one declaration; the offline keywords (as `LLM` passes them,
    every keyword of its own at its default) and the serve config read it the same way."""
    names = {
        f.metadata["vllm"]: f.name
        for cls in (RuntimeOptions, EngineOptions)
        for f in dataclasses.fields(cls)
        if f.metadata.get("vllm")
    }
    assert names["max_num_seqs"] == "max_running" and names["enable_prefix_caching"] == "prefix_cache"
    assert (
        names["max_num_batched_tokens"] == "chunk_size" and names["gpu_memory_utilization"] == "mem_fraction"
    )
    vllm = {"max_num_seqs": 8, "enable_prefix_caching": False, "dtype": "half", "kv_cache_dtype": "fp8"}
    offline = RuntimeOptions.of(max_running=None, prefix_cache=True, **vllm)  # as `LLM(**vllm)` passes them
    served = RuntimeOptions.of(**EngineArgs.model_validate(vllm).to_llm_kwargs())
    assert offline == served
    assert (served.max_running, served.prefix_cache) == (8, False)
    assert (served.engine.dtype, served.engine.kv_cache_dtype) == ("float16", "fp8_e4m3")
    with pytest.raises(ValueError, match="max_running and vLLM's name for it, max_num_seqs"):
        RuntimeOptions.of(max_running=4, max_num_seqs=8)
