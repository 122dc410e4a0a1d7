"""`eagle3`: an EAGLE-3 head in the public checkpoint layout (`LlamaForCausalLMEagle3`, a reduced draft
vocabulary with `d2t`/`t2d`, with and without its own embedding) loads, drafts, and the output is HF's
greedy output token for token; a head built to agree with its target has every draft accepted (which
fails if a draft id skipped `d2t` or a step read the wrong position); errors name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.layers.source import InMemorySource
from tandem.engine.spec.eagle3 import DraftVocabMap, aux_layer_ids

from ..engine.spec_heads import repeating, self_nearest, write_eagle3

K = 3
MAX_NEW = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def target(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 13, 30)]
    return model_dir, prompts, _greedy(model_dir, prompts), tmp_path_factory.mktemp("eagle3")


def _spec(head: Path, k: int = K) -> dict[str, Any]:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@pytest.mark.parametrize(
    ("own_embed", "prefix", "overlap"),
    [(False, "", True), (True, "model.", False)],
    ids=["target-embedding", "own-embedding"],
)
def test_a_public_layout_head_loads_drafts_and_changes_nothing(
    target: Any, own_embed: bool, prefix: str, overlap: bool
) -> None:
    model_dir, prompts, ref, tmp = target
    head = write_eagle3(
        tmp / f"random-{own_embed}", model_dir, draft_vocab=200, keep=[], own_embed=own_embed, prefix=prefix
    )
    llm = LLM(str(model_dir), device="cpu", overlap=overlap, chunk_size=16, speculative_config=_spec(head))
    drafter = llm.runtime.scheduler.spec.hidden.drafter  # type: ignore[union-attr]
    assert drafter.head.capture.layers == (1, 2, 3)
    assert hasattr(drafter.head, "embed_tokens") is own_embed
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 3 * len(prompts)
    # From the prefix cache (the head's KV shares the target's pages): still exact.
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert llm.stats()["kv_pages_used"] == 0
    llm.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_head_that_agrees_with_its_target_has_every_draft_accepted(target: Any, overlap: bool) -> None:
    """The repeating target's next token is its last one; the head maps the first captured state (that
    token's embedding) through its layer unchanged to the draft id of that token, and `d2t` must bring it
    back to the target's id. Drafts start from the last prompt position: a step one position off would
    propose the token before it."""
    model_dir, prompts, _, tmp = target
    rep = repeating(model_dir, tmp / "repeating")
    last = [p[-1] for p in prompts]
    assert set(last) <= set(self_nearest(rep))
    want = _greedy(rep, prompts)
    assert want == [[t] * MAX_NEW for t in last]
    head = write_eagle3(tmp / "agree", rep, draft_vocab=100, keep=last, agree=True)
    llm = LLM(str(rep), device="cpu", overlap=overlap, speculative_config=_spec(head))
    lengths = [MAX_NEW, 17, 19]  # rows near their end draft fewer than K beside rows drafting K
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, lengths, strict=True)]
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_mean_acceptance_length"] > K
    llm.shutdown()


def test_seeded_sampling_with_a_head_is_the_target_s(target: Any) -> None:
    model_dir, prompts, _, tmp = target
    head = write_eagle3(tmp / "sampling", model_dir, draft_vocab=300, keep=[], seed=3)
    plain = LLM(str(model_dir), device="cpu")
    spec = LLM(str(model_dir), device="cpu", speculative_config=_spec(head, 2))
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, presence_penalty=0.5, seed=4)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    plain.shutdown()
    spec.shutdown()


def test_d2t_maps_draft_ids_to_target_ids() -> None:
    mapping = DraftVocabMap(4, torch.device("cpu"))
    mapping.load(InMemorySource("d2t", torch.tensor([0, 2, 5, 5])), 0, is_bias=False)
    assert mapping(torch.tensor([3, 0, 1, 2])).tolist() == [8, 0, 3, 7]
    with pytest.raises(ValueError, match="d2t"):
        mapping.load(InMemorySource("d2t", torch.zeros(5, dtype=torch.int64)), 0, is_bias=False)


def test_aux_layers_come_from_the_config_or_vllm_s_default() -> None:
    assert aux_layer_ids({}, 32) == (2, 16, 29)
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [20, 1, 39]}}
    assert aux_layer_ids(ids, 40) == (1, 20, 39)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids({}, 4)  # the default repeats layer 2 at this depth
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 40]}}, 40)


def test_bad_heads_fail_at_start_naming_the_field(target: Any) -> None:
    model_dir, _, _, tmp = target
    # The target itself is no EAGLE-3 head.
    with pytest.raises(ValueError, match=r"speculative_config\.model .*LlamaForCausalLMEagle3"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(model_dir))
    # The default aux layers of a 4-layer target repeat one: the config must list them.
    head = write_eagle3(tmp / "no-ids", model_dir, draft_vocab=100, keep=[], layer_ids=None)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(head))
    # fc must read as many hidden states as the config lists layers.
    wide = write_eagle3(tmp / "two-ids", model_dir, draft_vocab=100, keep=[], layer_ids=(1, 2))
    (wide / "config.json").write_text((wide / "config.json").read_text().replace("[1, 2]", "[1, 2, 3]"))
    with pytest.raises(ValueError, match=r"speculative_config\.model .*fc\.weight"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(wide))
    # Method 'mtp' on a model without an MTP layer names the method.
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp'"):
        LLM(str(model_dir), device="cpu", speculative_config={"method": "mtp"})


def test_dummy_weights_draw_the_head_too(target: Any) -> None:
    """`load_format: dummy` reads the head's config.json only (benchmarks of shapes with no weights)."""
    model_dir, prompts, _, tmp = target
    head = write_eagle3(tmp / "dummy", model_dir, draft_vocab=100, keep=[])
    (head / "model.safetensors").unlink()
    llm = LLM(str(model_dir), device="cpu", load_format="dummy", speculative_config=_spec(head))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == [6] * len(prompts)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    llm.shutdown()


def test_grammar_rows_share_batches_with_drafted_rows(target: Any) -> None:
    """Structured-output rows never draft and their sample waits for their masks (the overlap loop's
    deferred sample): the head follows those batches once their tokens are stored, all stays exact."""
    from tandem.scheduler.sampling_params import StructuredOutputs

    model_dir, prompts, ref, tmp = target
    head = write_eagle3(tmp / "grammar", model_dir, draft_vocab=200, keep=[])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constrained = [
        SamplingParams(
            max_tokens=24, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(json=schema)
        )
        for s in range(2)
    ]
    params = [GREEDY] * len(prompts) + constrained
    every = prompts + prompts[:2]
    spec = LLM(str(model_dir), device="cpu", overlap=True, speculative_config=_spec(head))
    plain = LLM(str(model_dir), device="cpu", overlap=True)
    got = spec.generate(every, params, use_tqdm=False)
    want = plain.generate(every, params, use_tqdm=False)
    assert [o.token_ids for o in got[: len(prompts)]] == ref
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    spec.shutdown()
    plain.shutdown()
