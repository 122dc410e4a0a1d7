"""ProcessorConfig checks what a job asks for in the driver, before any actor starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.deploy.batch.actor_pool import map_batches_kwargs
from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.host import EngineSpec


def test_defaults_and_pool_sizes() -> None:
    config = ProcessorConfig(model_source="m")
    assert (config.batch_size, config.concurrency, config.tp_size, config.device) == (64, 1, 1, "auto")
    assert config.pool_size == (1, 1)
    assert ProcessorConfig(model_source="m", concurrency=(1, 4)).pool_size == (1, 4)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"concurrency": 0}, "concurrency must be"),
        ({"concurrency": (3, 2)}, "concurrency must be"),
        ({"engine_kwargs": {"max_runing": 8}}, "unknown engine option(s): max_runing"),
        ({"engine_kwargs": {"chunk_size": 0}}, "chunk_size"),
        ({"engine_kwargs": {"tensor_parallel_size": 2}, "tp_size": 4}, "disagree"),
        ({"engine_kwargs": {"quantization": "awq"}}, "quantization must be one of 'fp8'"),
        ({"engine_kwargs": {"max_num_seqs": 4, "max_running": 8}}, "max_running and vLLM's name"),
        ({"engine_kwargs": {"device": "cuda"}}, "device -> ProcessorConfig.device"),
        ({"tp_size": 0}, "tp_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_concurent_batches": 2}, "max_concurent_batches"),
    ],
)
def test_bad_configs_fail_in_the_driver(fields: dict, says: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ProcessorConfig(model_source="m", **fields)
    assert says in str(raised.value)


def test_vllm_engine_kwargs_become_tandem_options() -> None:
    """ray.data.llm's `vLLMEngineProcessorConfig(engine_kwargs=...)` names, as a Ray Data user passes them."""
    config = ProcessorConfig(
        model_source="m",
        engine_kwargs={
            "tensor_parallel_size": 2,
            "max_model_len": 256,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 128,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.5,
            "dtype": "half",
            "kv_cache_dtype": "fp8",
            "seed": 7,
        },
    )
    assert config.tp_size == 2
    assert config.engine_kwargs == {
        "max_model_len": 256,
        "max_running": 4,
        "chunk_size": 128,
        "prefix_cache": False,
        "mem_fraction": 0.5,
        "dtype": "float16",
        "kv_cache_dtype": "fp8_e4m3",
        "seed": 7,
    }


def test_each_actor_runs_batches_concurrently_on_one_engine() -> None:
    config = ProcessorConfig(model_source="m", concurrency=(2, 3), batch_size=16, max_concurrent_batches=5)
    spec = EngineSpec(model="m", tp_size=2, device="cuda", accelerator_type="H200")
    kwargs = map_batches_kwargs(config, spec, served_model_name="s")
    compute = kwargs["compute"]
    assert (compute.min_size, compute.max_size, compute.max_concurrent_calls_per_actor) == (2, 3, 5)
    assert kwargs["batch_size"] == 16 and kwargs["batch_format"] == "pyarrow"
    assert kwargs["fn_constructor_kwargs"] == {"spec": spec, "served_model_name": "s"}
    # A sliver of a CPU (the actor mostly waits on its ranks); the GPUs are the rank actors'.
    assert 0.0 < kwargs["num_cpus"] < 1.0 and "num_gpus" not in kwargs
    bundle = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H200": 0.001}
    assert spec.bundles() == [bundle, bundle]
    assert EngineSpec(model="m", device="cpu", cpus_per_rank=2.0).bundles() == [{"CPU": 2.0}]
