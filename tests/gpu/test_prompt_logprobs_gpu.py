"""Prompt log-probs on CUDA: the asking rows' prompt positions through the LM head beside a batch that
otherwise runs its graphs (decode graphs for the other rows' steps, piecewise prefill graphs), against
the same engine's float32 eager run and HF on the same weights; the plain rows' tokens unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "num_pages": 512,
    "cuda_graph_max_bs": 16,
    "piecewise_max_tokens": 1024,
}


def _hf(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
    targets = torch.tensor(prompt[1:], device="cuda")[:, None]
    return logits.log_softmax(-1)[:-1].gather(1, targets).squeeze(1).cpu()


@pytest.mark.parametrize("chunk_size", [64, 8192])
def test_prompt_logprobs_on_cuda_match_hf_and_leave_other_rows_alone(
    gpu_model_dir: Callable[[str], Path],
    assert_same_greedy: Callable[[list[Any], list[Any]], None],
    chunk_size: int,
) -> None:
    model_dir = gpu_model_dir("qwen3")
    prompt = [(7 * i + 3) % 500 for i in range(200)]
    others = [[(11 * i + 5) % 500 for i in range(40)], [(13 * i + 1) % 500 for i in range(90)]]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    asking = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=5)
    expected = _hf(model_dir, prompt)
    for dtype, atol in (("float32", 2e-3), ("bfloat16", 0.15)):
        llm = LLM(str(model_dir), dtype=dtype, chunk_size=chunk_size, **OPTIONS)
        try:
            alone = llm.generate(others, plain, use_tqdm=False)
            mixed = llm.generate([*others, prompt], [plain, plain, asking], use_tqdm=False)
            (again,) = llm.generate([prompt], asking, use_tqdm=False)  # its pages are cached now
        finally:
            llm.shutdown()
        assert_same_greedy(mixed[:2], alone)
        for out in (mixed[2], again):
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            assert out.num_cached_tokens == 0
            got = torch.tensor(out.prompt_logprobs[1:])
            torch.testing.assert_close(got, expected, atol=atol, rtol=0)
            assert out.prompt_top_logprobs is not None and len(out.prompt_top_logprobs[1]) == 5
