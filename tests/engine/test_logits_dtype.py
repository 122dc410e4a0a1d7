"""The LM head's logits stay in the model dtype (the sampler's one-pass race reads them as they are);
only a final soft-cap computes in float32. Every sampling path gives the tokens of the float32 copy."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.batch import SamplingBatch
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.streams import StreamSet


@pytest.mark.parametrize(("family", "want"), [("qwen3", torch.bfloat16), ("gemma2", torch.float32)])
def test_logits_dtype_follows_model_and_softcap(family: str, want: torch.dtype, tiny_model_dir) -> None:
    config = resolve_engine_config(tiny_model_dir(family), device="cpu", dtype="bfloat16", num_pages=32)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    assert engine.model.logits_dtype == want
    assert (engine.model.config.final_softcap is not None) == (want == torch.float32)
    hidden = torch.randn(3, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = engine.model.compute_logits(hidden.to(torch.bfloat16))
        assert logits.dtype == want
        result = engine.sampler(logits, SamplingBatch.greedy(3))
    assert torch.equal(result.next_tokens, logits.float().argmax(-1))


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_logits_written_into_a_fixed_buffer_are_the_same(family: str, tiny_model_dir) -> None:
    """What a decode graph captures: the LM head writing into one buffer of the padded vocab's width
    (the GEMM's own output without a soft-cap, a copy after it with one) gives the same logits."""
    config = resolve_engine_config(tiny_model_dir(family), device="cpu", dtype="bfloat16", num_pages=32)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    model = engine.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    buffer = torch.full((5, model.lm_head.padded_vocab), float("nan"), dtype=model.logits_dtype)
    with torch.inference_mode():
        want = model.compute_logits(hidden.to(torch.bfloat16))
        got = model.compute_logits(hidden.to(torch.bfloat16), out=buffer[:3])
    assert torch.equal(got, want)
    assert got.data_ptr() == buffer.data_ptr()  # a view of the buffer, not a new tensor
    assert bool(buffer[3:].isnan().all())  # rows past the batch untouched
