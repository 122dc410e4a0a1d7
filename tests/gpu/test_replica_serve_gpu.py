"""Issue 4 on a GPU host: a TP=1 replica under Ray Serve, on the NCCL init path with CUDA streams."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_tp1_replica_under_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import ray
    from ray import serve

    from tandem import LLM, SamplingParams
    from tandem.engine.tiny import make_tiny_model
    from tandem.replicas.llm_replica import LLMReplica

    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3")
    prompt = [5, 6, 7, 8, 9, 10]

    @serve.deployment(
        placement_group_bundles=LLMReplica.placement_bundles(1, "cuda", replica_cpus=1.0),
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": 1},
    )
    class Server:
        def __init__(self) -> None:
            self.replica = LLMReplica(str(model_dir), tp_size=1, device="cuda")

        async def run(self) -> dict[str, Any]:
            tokens: list[int] = []
            async for chunk in self.replica.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0)):
                tokens += chunk.token_ids
            await self.replica.check_health()
            return {"tokens": tokens, "ranks": await self.replica.describe_ranks()}

    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False)
    try:
        handle = serve.run(Server.bind(), name="gpu-replica", route_prefix=None)
        result = handle.run.remote().result(timeout_s=600)
    finally:
        serve.shutdown()
        ray.shutdown()
    rank = result["ranks"][0]
    assert rank["backend"] == "nccl"
    assert rank["device"].startswith("cuda") and rank["cuda_streams"] and rank["distinct_streams"] == 3
    offline = LLM(str(model_dir), device="cuda").generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0)
    )
    assert result["tokens"] == offline[0].token_ids
