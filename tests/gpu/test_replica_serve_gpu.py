"""On GPU hosts: a replica under Ray Serve on the NCCL init path with CUDA streams, at TP=1
and (with two GPUs) TP=2. float32, so TP=2 must give exactly TP=1's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], list(range(20, 70))]
ENGINE = {"dtype": "float32", "num_pages": 2048}  # leave the GPUs to the other tests


@pytest.fixture(scope="module")
def ray_gpus():  # type: ignore[no-untyped-def]
    import ray

    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    yield torch.cuda.device_count()
    ray.shutdown()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_replica_under_serve(ray_gpus: int, tp_size: int, tmp_path: Path) -> None:
    if ray_gpus < tp_size:
        pytest.skip(f"needs {tp_size} GPUs")
    from ray import serve

    from tandem import LLM, SamplingParams
    from tandem.engine.tiny import make_tiny_model
    from tandem.replicas.llm_replica import LLMReplica

    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2")  # q/k/v biases: rank 0 adds them once
    greedy = SamplingParams(max_tokens=24, temperature=0.0)

    @serve.deployment(
        placement_group_bundles=LLMReplica.placement_bundles(tp_size, "cuda", replica_cpus=1.0),
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": 1},
    )
    class Server:
        def __init__(self) -> None:
            self.replica = LLMReplica(str(model_dir), tp_size=tp_size, device="cuda", engine=ENGINE)

        async def run(self) -> dict[str, Any]:
            outs = []
            for prompt in PROMPTS:
                tokens: list[int] = []
                async for chunk in self.replica.generate(prompt, greedy):
                    tokens += chunk.token_ids
                outs.append(tokens)
            await self.replica.check_health()
            return {"tokens": outs, "ranks": await self.replica.describe_ranks()}

    try:
        handle = serve.run(Server.bind(), name=f"gpu-tp{tp_size}", route_prefix=None)
        result = handle.run.remote().result(timeout_s=600)
    finally:
        serve.shutdown()
    assert len(result["ranks"]) == tp_size
    for rank in result["ranks"]:
        assert rank["backend"] == "nccl"
        assert rank["device"].startswith("cuda") and rank["cuda_streams"] and rank["distinct_streams"] == 3
    offline_llm = LLM(str(model_dir), device="cuda", **ENGINE)
    offline = offline_llm.generate(PROMPTS, greedy, use_tqdm=False)
    offline_llm.shutdown()
    assert result["tokens"] == [o.token_ids for o in offline]
