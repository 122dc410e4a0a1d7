"""Structured outputs, logit_bias and min_tokens through the offline API on a random-weight tiny model:
only real masking can make a random model write schema-valid JSON or honour a bias."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.batch import SamplingBatch
from tandem.engine.sampler import Sampler
from tandem.scheduler.messages import GrammarSpec
from tandem.scheduler.sampling_params import StructuredOutputs, to_spec
from tandem.scheduler.structured.grammar import GrammarCache, choice_grammar

# Nested objects, an array of enums, bounded integers and patterned strings: every branch closes.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "maximum": 4}},
            "required": ["kind", "legs"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "pet", "ok"],
}


def _llm(tiny_model_dir: Any, overlap: bool) -> LLM:
    return LLM(str(tiny_model_dir("qwen3")), device="cpu", page_size=4, overlap=overlap)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return _llm(tiny_model_dir, overlap=True)


def _schema_params(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=96, temperature=1.0, seed=seed, structured_outputs=StructuredOutputs(json=SCHEMA)
    )


def test_json_schema_outputs_validate_in_a_batch_mixed_with_plain_rows(llm: LLM, tiny_model_dir: Any) -> None:
    plain = [SamplingParams(max_tokens=12, temperature=0.0)] * 2
    prompts = ["a poem about the sea", "the capital of"]
    alone = llm.generate(prompts[:2], plain, use_tqdm=False)
    mixed = llm.generate(
        prompts[:2] + prompts * 2, plain + [_schema_params(s) for s in range(4)], use_tqdm=False
    )
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]  # plain rows unaffected
    for out in mixed[2:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # The normal loop masks at launch, the overlap loop after the previous step: the same tokens.
    normal = _llm(tiny_model_dir, overlap=False)
    try:
        again = normal.generate(
            prompts[:2] + prompts * 2, plain + [_schema_params(s) for s in range(4)], use_tqdm=False
        )
    finally:
        normal.shutdown()
    assert [o.token_ids for o in again] == [o.token_ids for o in mixed]


def test_a_head_wider_than_the_tokenizer_never_yields_ids_without_text(tiny_model_dir: Any) -> None:
    """A padded head (2,048 logits over the 512-id tokenizer): the masks speak for the tokenizer's ids,
    and the sampler rules out the rest, which a random model would otherwise draw often."""
    llm = LLM(str(tiny_model_dir("qwen3", vocab_size=2048)), device="cpu", page_size=4)
    try:
        known = len(llm.tokenizer)
        params = [_schema_params(s) for s in range(6)]
        outs = llm.generate(["a poem about the sea"] * 6, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        assert out.finish_reason == "stop" and max(out.token_ids) < known, (out.finish_reason, out.token_ids)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_overlap_loop_fills_masks_before_processing_the_previous_batch(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masks of batch N+1 start filling (on the filler's worker) as soon as N's tokens are accepted,
    before the rest of N's results are processed and the batch after is planned, so these overlap on
    the host."""
    scheduler = llm.runtime.scheduler
    behind: list[int] = []  # per mask fill: its batch id less the last processed batch's
    planned: list[int | None] = []  # per masked sample: the id of the batch planned before it, if any
    launcher = scheduler.launcher
    start_masks, sample = launcher.start_masks, launcher.sample

    def recording_start(flight: Any) -> None:
        behind.append(flight.prepared.batch_id - scheduler.last_processed)
        start_masks(flight)

    def recording_sample(flight: Any) -> None:
        early = scheduler._planned
        planned.append(None if early is None else early.batch_id - flight.prepared.batch_id)
        sample(flight)

    monkeypatch.setattr(launcher, "start_masks", recording_start)
    monkeypatch.setattr(launcher, "sample", recording_sample)
    outs = llm.generate(["a poem about the sea"] * 2, [_schema_params(s) for s in range(2)], use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outs)
    assert len(behind) >= min(len(o.token_ids) for o in outs)
    # The first constrained batch has no previous one to process; every later one starts filling while
    # batch N is still unprocessed (N+1 - (N-1) = 2), not after (that would be 1).
    assert behind[1:] == [2] * (len(behind) - 1), behind
    # Each masked sample after the first comes after the next batch was planned (until there is none).
    assert planned[0] is None and set(planned[1:-2]) == {1}, planned


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (
            StructuredOutputs(choice=["yes", "no", 'a "quoted" one']),
            lambda t: t in ("yes", "no", 'a "quoted" one'),
        ),
        (
            StructuredOutputs(regex=r"[0-9]{3}-[a-c]{2}"),
            lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit(),
        ),
        (
            StructuredOutputs(grammar='root ::= "(" [a-z]{1,5} ")"'),
            lambda t: t.startswith("(") and t.endswith(")"),
        ),
    ],
)
def test_choice_regex_and_grammar(llm: LLM, structured: StructuredOutputs, check: Any) -> None:
    params = [SamplingParams(max_tokens=24, seed=s, structured_outputs=structured) for s in range(4)]
    for out in llm.generate(["answer:"] * 4, params, use_tqdm=False):
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_json_object_parses(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=32, temperature=0.0, structured_outputs=StructuredOutputs(json_object=True)
    )
    out = llm.generate(["json:"], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_logit_bias_and_min_tokens(llm: LLM) -> None:
    prompt = [[7, 8, 9, 10]]
    free = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    forced = free.token_ids[0] + 1
    biased = llm.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={forced: 100.0}), use_tqdm=False
    )[0]
    assert biased.token_ids == [forced] * 6
    banned = llm.generate(
        prompt,
        SamplingParams(max_tokens=6, temperature=0.0, logit_bias={free.token_ids[0]: -100.0}),
        use_tqdm=False,
    )[0]
    assert banned.token_ids[0] != free.token_ids[0]
    # The first greedy token made a stop token: alone it ends the output at once; min_tokens holds it.
    stop = free.token_ids[0]
    short = llm.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop]), use_tqdm=False
    )
    assert short[0].token_ids == [stop] and short[0].finish_reason == "stop"
    held = llm.generate(
        prompt,
        SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop], min_tokens=3),
        use_tqdm=False,
    )[0]
    assert len(held.token_ids) >= 3 and stop not in held.token_ids[:3]


def test_logit_bias_is_capped_and_validated() -> None:
    spec = to_spec(SamplingParams(logit_bias={5: 1e9, 2: -1e9}))
    assert spec.logit_bias == ((2, -100.0), (5, 100.0))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0}).validate()  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", json_object=True)).validate()


def test_sampler_applies_bias_and_bitmask_to_their_rows_only() -> None:
    vocab = 70
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.greedy(3)
    plain = Sampler(vocab)(logits, batch).next_tokens
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 9  # row 2 may only take token 41
    constrained = Sampler(vocab)(
        logits,
        replace(
            batch,
            bias_rows=torch.tensor([0]),
            bias_ids=torch.tensor([13]),
            bias_values=torch.tensor([1e4]),
            bitmask=bitmask,
            bitmask_rows=torch.tensor([2]),
        ),
    ).next_tokens
    assert constrained.tolist() == [13, int(plain[1]), 41]


def test_compile_errors_name_the_reason(tiny_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    from tandem.scheduler.structured.grammar import hf_tokenizer_info

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    cache = GrammarCache(lambda: hf_tokenizer_info(tokenizer, (tokenizer.eos_token_id,)))
    try:
        with pytest.raises(ValueError, match="foo"):
            cache.compile(GrammarSpec("json_schema", '{"type": "foo"}')).result()
        with pytest.raises(ValueError, match="Unclosed"):
            cache.compile(GrammarSpec("regex", "[a-")).result()
        spec = GrammarSpec("regex", "a+")
        assert cache.compile(spec) is cache.compile(spec)  # compiled once
    finally:
        cache.close()
    assert choice_grammar(['a"b', "c"]) == 'root ::= "a\\"b" | "c"'


def test_bitmask_filler_matches_each_matcher_alone(tiny_model_dir: Any) -> None:
    """The filler's rows, filled on its worker over two threads while this thread goes on, are each the
    mask its matcher gives alone."""
    from concurrent.futures import Future

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tandem.scheduler.structured.grammar import (
        BitmaskFiller,
        GrammarState,
        compile_spec,
        hf_tokenizer_info,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    info = hf_tokenizer_info(tokenizer, (tokenizer.eos_token_id,))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled: Future[xgr.CompiledGrammar] = Future()
    compiled.set_result(compile_spec(compiler, GrammarSpec("json_schema", json.dumps(SCHEMA))))
    text = '{"name": "ab", "age": 30, "tags": ["red"'  # xgrammar's separators: ", " and ": "

    def placed(n: int) -> GrammarState:  # a matcher n places into the object
        state = GrammarState(compiled)
        for token in tokenizer.encode(text[: 5 * n], add_special_tokens=False):
            assert state.accept(token)
        return state

    states = [placed(n) for n in range(8)]

    def alone(state: GrammarState) -> torch.Tensor:
        mask = xgr.allocate_token_bitmask(1, state.vocab_size)
        matcher = state.matcher()
        assert matcher is not None
        matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    filler = BitmaskFiller(threads=2)
    masks = filler.start(states).result()
    for row, state in enumerate(states):
        assert torch.equal(masks[row], alone(state))
    assert len({tuple(m.tolist()) for m in masks}) > 1  # the rows really differ

    # The host buffers are reused, in turn and grown when a batch has more rows: each fill still gives
    # its own rows' masks, and a row whose compile failed allows every token.
    broken: Future[xgr.CompiledGrammar] = Future()
    broken.set_exception(ValueError("no grammar"))
    # Every row its own matcher, as every request has: two threads filling one matcher's rows at once is
    # no case the scheduler makes (xgrammar's matchers are not thread-safe).
    grown = states[:3] + [GrammarState(broken)] + [placed(n % 8) for n in range(16)]
    for batch in (states[::-1], states[2:5], grown):
        masks = filler.fill(batch)
        assert masks.shape[0] == len(batch)
        for row, state in enumerate(batch):
            expected = alone(state) if state.failed is None else torch.full_like(masks[row], -1)
            assert torch.equal(masks[row], expected)
        on_device, rows = filler.upload(masks, list(range(1, 2 * len(batch), 2)), torch.device("cpu"))
        assert torch.equal(on_device, masks) and rows.tolist() == list(range(1, 2 * len(batch), 2))


def test_batched_accepts_record_what_each_matcher_says_alone(tiny_model_dir: Any) -> None:
    """`accept_tokens` advances a batch of states in one call into xgrammar: each state's `refused` and
    `terminated` are what its own matcher says for its token, a refused token leaves its matcher where
    it was, and a state whose compile failed is refused."""
    from concurrent.futures import Future

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tandem.scheduler.structured.grammar import (
        GrammarState,
        accept_tokens,
        compile_spec,
        hf_tokenizer_info,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    eos = tokenizer.eos_token_id
    compiler = xgr.GrammarCompiler(hf_tokenizer_info(tokenizer, (eos,)), cache_enabled=False)
    compiled: Future[xgr.CompiledGrammar] = Future()
    compiled.set_result(compile_spec(compiler, GrammarSpec("choice", json.dumps(["ab", "cd"]))))
    broken: Future[xgr.CompiledGrammar] = Future()
    broken.set_exception(ValueError("no grammar"))

    def state(text: str) -> GrammarState:
        made = GrammarState(compiled)
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert made.accept(token)
        return made

    a, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "c"))
    states = [state(""), state(""), state("ab"), GrammarState(broken), state("cd")]
    tokens = [a, eos, eos, a, c]  # a start; an end too early; an end; no grammar; past the end
    accept_tokens(states, tokens)
    assert [s.refused for s in states] == [False, True, False, True, True]
    assert [s.terminated for s in states] == [False, False, True, False, False]
    # Refused: still at the start, where "c" is allowed.
    assert states[1].accept(c) and not states[1].terminated
    accept_tokens([], [])  # nothing to accept: no call into xgrammar


@pytest.mark.parametrize("overlap", [True, False])
def test_a_constraint_starts_after_its_token(tiny_model_dir: Any, overlap: bool) -> None:
    """`after_token` (a reasoning model's `</think>`, under `--reasoning-parser`): the output is free until
    that token, then follows the schema. A bias forces the token first, where the schema forbids it."""
    llm = _llm(tiny_model_dir, overlap)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (end,) = llm.tokenizer.encode("Q", add_special_tokens=False)
    for seed in range(3):
        constraint = StructuredOutputs(json=schema, after_token=end)
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, logit_bias={end: 100.0},
                                structured_outputs=constraint)  # fmt: skip
        (out,) = llm.generate(["think first"], params, use_tqdm=False)
        assert out.token_ids[0] == end and out.finish_reason == "stop"
        after = llm.tokenizer.decode(out.token_ids[1:], skip_special_tokens=True)
        jsonschema.validate(json.loads(after), schema)
        plain = replace(params, structured_outputs=StructuredOutputs(json=schema))
        (constrained,) = llm.generate(["think first"], plain, use_tqdm=False)
        assert end not in constrained.token_ids  # from the first token: the schema never allows it
        jsonschema.validate(json.loads(constrained.text), schema)
