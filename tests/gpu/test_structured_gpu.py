"""Structured outputs on CUDA: xgrammar's Triton bitmask kernel, pinned bitmask copies, masks filled after
the previous step under the overlap loop, with decode CUDA graphs on; plain rows batched with
constrained ones keep their greedy tokens (near-ties excepted, see conftest)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.scheduler.sampling_params import StructuredOutputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "num_pages": 512,
    "cuda_graph_max_bs": 16,
    "piecewise_max_tokens": 1024,
}


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_rows_validate_and_plain_rows_keep_their_tokens(
    gpu_model_dir: Callable[[str], Path],
    assert_same_greedy: Callable[[list[Any], list[Any]], None],
    overlap: bool,
) -> None:
    llm = LLM(str(gpu_model_dir("qwen3")), overlap=overlap, **OPTIONS)
    try:
        plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
        prompts = [[5 + i, 40 + 3 * i, 200 + i] for i in range(6)]
        alone = llm.generate(prompts, plain, use_tqdm=False)
        constrained = [
            SamplingParams(max_tokens=80, seed=s, structured_outputs=StructuredOutputs(json=SCHEMA))
            for s in range(10)
        ]
        mixed = llm.generate(prompts + [[9, 9, 9]] * 10, [plain] * 6 + constrained, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_same_greedy(alone, mixed[:6])
    for out in mixed[6:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
