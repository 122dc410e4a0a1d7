"""Structured outputs stay RFC 8259 JSON for every schema tandem accepts, bounded strings included, with a
byte-level BPE tokenizer that has a token for every byte (so any control character or stray UTF-8 byte is
one token away), a random-weight model at temperature 1.0 and many seeds: strict UTF-8, strict
`json.loads`, `jsonschema` validation. Also patterns, enums and the strict schemas the OpenAI SDK's
`parse()` sends for Pydantic models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem import LLM, SamplingParams
from tandem.engine.tiny.factory import make_tiny_model
from tandem.scheduler.sampling_params import StructuredOutputs
from tandem.scheduler.structured.json_strings import rewrite_bounded_strings

SEEDS = 16  # 4 schemas x 16 seeds: one batch of 64 rows, the CPU engine's max_running


class Step(BaseModel):
    explanation: str = Field(max_length=10)
    value: int


class Answer(BaseModel):
    steps: list[Step] = Field(max_length=2)
    final: str = Field(min_length=1, max_length=8)
    sure: bool


SCHEMAS: dict[str, dict[str, Any]] = {
    "bounded": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "code": {"type": "string", "minLength": 2, "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        },
        "required": ["city", "code", "tags"],
    },
    "pattern": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "note": {"type": "string", "pattern": "^.{0,8}$"},
        },
        "required": ["id", "note"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", 'gr"een', "blue\n", "\u00e9t\u00e9"]},
            "size": {"type": "string", "enum": ["S", "M"]},
        },
        "required": ["color", "size"],
    },
    "pydantic": to_strict_json_schema(Answer),  # what client.beta.chat.completions.parse() sends
}


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose alphabet is all 256 bytes, with merges learnt on JSON-like text, so tokens
    also span quotes, braces and characters together."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"city": "Paris", "code": "FR", "tags": ["a", "b"], "note": "x\ny"})] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedTokenizerFast]:
    tokenizer = _byte_level_tokenizer()
    vocab = tokenizer.get_vocab()
    assert all(ch in vocab for ch in _bytes_to_unicode()) and len(vocab) > 257  # every byte, and merges
    eos = tokenizer.eos_token_id
    ids = {"pad_token_id": eos, "bos_token_id": eos, "eos_token_id": eos}
    path = make_tiny_model(tmp_path_factory.mktemp("byte-model"), "llama", vocab_size=len(vocab), **ids)
    tokenizer.save_pretrained(path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
        (path / name).write_text(json.dumps(config))
    return path, tokenizer


def _utf8(tokenizer: PreTrainedTokenizerFast, token_ids: list[int]) -> str:
    """The bytes the tokens stand for, decoded strictly: invalid UTF-8 fails here rather than becoming
    U+FFFD (which a lenient decoder would count as characters of the string)."""
    table = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    pieces = [tokenizer.convert_ids_to_tokens(t) for t in token_ids if t != tokenizer.eos_token_id]
    raw = bytes(table[ch] for piece in pieces for ch in piece)
    return raw.decode("utf-8")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def test_every_schema_gives_strict_valid_json_at_temperature_one(
    byte_model: tuple[Path, PreTrainedTokenizerFast],
) -> None:
    path, tokenizer = byte_model
    llm = LLM(str(path), device="cpu", page_size=16)
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        for seed in range(SEEDS):
            prompts.append([tokenizer.eos_token_id, 40 + seed % 50])
            params.append(SamplingParams(max_tokens=128, temperature=1.0, seed=seed,
                                         structured_outputs=StructuredOutputs(json=schema)))  # fmt: skip
            names.append(name)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    finished = {name: 0 for name in SCHEMAS}
    for name, out in zip(names, outputs):
        if out.finish_reason == "length":
            continue  # cut before the grammar closed: not a complete document
        assert out.finish_reason == "stop", out
        finished[name] += 1
        text = _utf8(tokenizer, out.token_ids)
        value = json.loads(text)  # strict: raw control characters inside strings are refused
        jsonschema.validate(value, SCHEMAS[name])
        assert out.text == text
    assert all(count >= SEEDS * 3 // 4 for count in finished.values()), finished


def test_bounded_strings_become_patterns_and_nothing_else_changes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
              "b": {"type": "string", "pattern": "^x$", "maxLength": 2}, "c": {"type": "integer"}},
              "$defs": {"d": {"type": "string", "minLength": 1}}}  # fmt: skip
    out = rewrite_bounded_strings(schema)
    assert "maxLength" not in out["properties"]["a"] and out["properties"]["a"]["pattern"].endswith("{0,3}$")
    assert out["$defs"]["d"]["pattern"].endswith("{1,}$")
    assert out["properties"]["b"] == schema["properties"]["b"]  # its pattern already decides the content
    assert out["properties"]["c"] == {"type": "integer"}
    assert list(out["properties"]) == ["a", "b", "c"]  # key order is the output's property order
