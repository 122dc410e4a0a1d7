"""On GPU hosts: `tandem.batch` with its engine on the GPU (rank actors in the actor's own placement
group, one GPU each) at TP=1 and, with two GPUs, TP=2. float32, so every run gives `LLM.generate`'s tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ENGINE = {"dtype": "float32", "num_pages": 2048}  # leave the GPUs to the other tests
ROWS = 40


@pytest.fixture(scope="module")
def ray_gpus() -> Any:
    import ray

    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    yield torch.cuda.device_count()
    ray.shutdown()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_processor_on_the_gpu_matches_llm_generate(ray_gpus: int, tp_size: int, tmp_path: Path) -> None:
    if ray_gpus < tp_size:
        pytest.skip(f"needs {tp_size} GPUs")
    import ray

    from tandem import LLM, SamplingParams
    from tandem.batch import ProcessorConfig, build_processor
    from tandem.engine.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3")
    prompts = [f"row {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(ROWS)]
    llm = LLM(str(model_dir), device="cuda", **ENGINE)
    want = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()

    config = ProcessorConfig(
        model_source=str(model_dir), tp_size=tp_size, batch_size=8, device="cuda", engine_kwargs=ENGINE
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "prompt": prompts[int(row["id"])],
            "sampling_params": {"max_tokens": 16, "temperature": 0.0},
        },
    )
    rows = sorted(processor(ray.data.range(ROWS)).take_all(), key=lambda row: int(row["id"]))
    assert [row["error"] for row in rows] == [None] * ROWS
    assert [list(row["generated_tokens"]) for row in rows] == [out.token_ids for out in want]
