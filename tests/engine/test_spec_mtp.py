"""`mtp`: a tiny DeepSeek-V3 with its MTP layer (`num_nextn_predict_layers: 1`) drafts with that layer,
reused for each of K steps, and its greedy output is HF's (which ignores the layer) token for token, in
both loops and over chunked prefill; a layer built to agree with its target has every draft accepted;
a checkpoint without the layer's tensors fails naming the method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.spec.mtp import MtpHead

from .spec_heads import repeating, with_mtp_layer
from .test_moe_models import hf_greedy, prompts_for

CHUNK = 16
MAX_NEW = 16  # test_moe_models' hf_greedy length
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def v3(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("deepseek_v3")
    tmp = tmp_path_factory.mktemp("mtp")
    prompts = prompts_for(512)
    return model_dir, prompts, hf_greedy(model_dir, prompts), tmp


def _spec(k: int) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_mtp_layer_drafts_and_changes_nothing(v3: Any, overlap: bool) -> None:
    model_dir, prompts, want, tmp = v3
    mtp = with_mtp_layer(model_dir, tmp / "mtp")
    llm = LLM(str(mtp), device="cpu", overlap=overlap, chunk_size=CHUNK, speculative_config=_spec(2))
    head = llm.runtime.scheduler.spec.hidden.drafter.head  # type: ignore[union-attr]
    assert isinstance(head, MtpHead) and head.capture.layers == ()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 2 * len(prompts)
    llm.shutdown()


def test_a_layer_that_agrees_with_its_target_has_every_draft_accepted(v3: Any) -> None:
    """The repeating target's next token is its last one, and the agreeing layer proposes the token it
    is given: every draft of every step (the one layer run K times) is accepted."""
    model_dir, prompts, _, tmp = v3
    rep = repeating(model_dir, tmp / "repeating")
    want = hf_greedy(rep, prompts)
    assert want == [[p[-1]] * MAX_NEW for p in prompts]
    agree = with_mtp_layer(rep, tmp / "agree", agree=True)
    llm = LLM(str(agree), device="cpu", chunk_size=CHUNK, speculative_config=_spec(3))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens_per_pos"][2] > 0
    llm.shutdown()


def test_a_checkpoint_without_the_layer_fails_naming_the_method(v3: Any) -> None:
    model_dir: Path = v3[0]  # its config.json says num_nextn_predict_layers: 1, its weights have none
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp'.*enorm"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(1))


def test_dummy_weights_draw_the_mtp_layer_too(v3: Any) -> None:
    model_dir: Path = v3[0]
    llm = LLM(str(model_dir), device="cpu", load_format="dummy", speculative_config=_spec(2))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [len(o.token_ids) for o in llm.generate(v3[1], params, use_tqdm=False)] == [6] * len(v3[1])
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    llm.shutdown()
