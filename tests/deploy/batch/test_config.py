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
        ({"engine_kwargs": {"tensor_parallel_size": 2}}, "tensor_parallel_size -> ProcessorConfig.tp_size"),
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
