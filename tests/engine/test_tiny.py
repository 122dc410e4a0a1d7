"""The tiny-model factory: every family loads cleanly in transformers, the tokenizer is exact and stable,
and the weights give decisive, varied greedy decodes (which the engine-vs-HF token tests rely on)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tandem.engine.tiny import FAMILIES, default_model_dir, load_tiny_tokenizer, make_tiny_model, tiny_config
from tandem.engine.tiny.tokenizer import HARMONY_TOKENS, train_tiny_backend

TinyDir = Callable[..., Path]

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss"),
}
EOT, IM_START, IM_END = 509, 510, 511

ROUND_TRIP = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\nCRLF",
    "Grüße aus Köln — naïve café, façade, ¿qué tal? ñ",
    "日本語のテキスト、中文文本, 한국어 텍스트",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 and flags 🇯🇵",
    "math ∑∫√∞ ≠ ≤ ≥, zero\u200bwidth, nul\x00byte, \U0010ffff",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # ok\n",
    "text with <|im_end|> inside and <|endoftext|>",
]


def _load(path: Path) -> PreTrainedModel:
    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_dir_loads_in_transformers(family: str, tiny_model_dir: TinyDir) -> None:
    path = tiny_model_dir(family)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    raw = json.loads((path / "config.json").read_text())
    arch, model_type = ARCHITECTURES[family]
    assert raw["architectures"] == [arch] and raw["model_type"] == model_type
    assert raw["eos_token_id"] == [EOT, IM_END] and raw["pad_token_id"] == EOT
    model = _load(path)
    assert type(model).__name__ == arch
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for t in load_file(path / "model.safetensors").values())
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token) == (EOT, EOT, None)
    if family == "gpt_oss":  # the harmony markers after the 512 ids, and no template: tandem's harmony one
        assert len(tok) == model.config.vocab_size == 512 + len(HARMONY_TOKENS)
        assert tok.convert_tokens_to_ids(list(HARMONY_TOKENS)) == list(range(512, 512 + len(HARMONY_TOKENS)))
        assert tok.chat_template is None
    else:
        assert len(tok) == model.config.vocab_size == 512
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOT, IM_END]


def test_family_specific_config(tiny_model_dir: TinyDir) -> None:
    cfg = {f: json.loads((tiny_model_dir(f) / "config.json").read_text()) for f in FAMILIES}
    for c in cfg.values():
        assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (64, 4, 2)
        assert (c["head_dim"], c["intermediate_size"], c["max_position_embeddings"]) == (16, 128, 2048)
    assert cfg["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["llama"]["rope_parameters"]["original_max_position_embeddings"] == 256
    assert cfg["llama"]["tie_word_embeddings"] and cfg["qwen3"]["tie_word_embeddings"]
    assert cfg["mistral"]["sliding_window"] == 32
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2 and g2["sliding_window"] == 32
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2["query_pre_attn_scalar"] == g3["query_pre_attn_scalar"] == 16
    assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and g3["sliding_window"] == 32
    assert g3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert g3["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    weights = load_file(tiny_model_dir("qwen2") / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert "model.layers.0.self_attn.q_norm.weight" in load_file(
        tiny_model_dir("qwen3") / "model.safetensors"
    )


def test_overrides_and_seed(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "a", "gemma2", seed=3, num_hidden_layers=2, sliding_window=8)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["sliding_window"], len(cfg["layer_types"])) == (2, 8, 2)
    again = load_file(
        make_tiny_model(tmp_path / "b", "gemma2", seed=3, num_hidden_layers=2) / "model.safetensors"
    )
    other = load_file(
        make_tiny_model(tmp_path / "c", "gemma2", seed=4, num_hidden_layers=2) / "model.safetensors"
    )
    first = load_file(path / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)  # the window is not a weight
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    llama = tiny_config("llama", rope_scaling=None, rope_theta=1234.0)
    assert llama.rope_parameters == {"rope_type": "default", "rope_theta": 1234.0}


def test_unknown_family_names_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        make_tiny_model(tmp_path, "gpt2")
    assert all(f in str(err.value) for f in FAMILIES)
    assert not any(tmp_path.iterdir())


def test_tokenizer_round_trips_exactly(tiny_model_dir: TinyDir) -> None:
    tok = load_tiny_tokenizer()
    saved = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    for text in ROUND_TRIP:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert tok.decode(ids) == text
        assert saved(text)["input_ids"] == ids
    # No BOS is prepended, and the specials are single ids at the top of the vocabulary.
    assert tok("hi")["input_ids"] == tok.encode("hi", add_special_tokens=False)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        EOT,
        IM_START,
        IM_END,
    ]
    assert tok("a<|im_end|>b")["input_ids"][1] == IM_END
    assert tok.decode([IM_START, EOT], skip_special_tokens=True) == ""


def test_tokenizer_is_deterministic() -> None:
    assert train_tiny_backend().to_str() == train_tiny_backend().to_str()
    assert len(load_tiny_tokenizer()) == 512


def test_widened_tokenizer_has_text_for_every_id_and_keeps_the_first_512() -> None:
    tiny, wide = load_tiny_tokenizer(), load_tiny_tokenizer(4096)
    assert len(wide) == 4096 and sorted(wide.get_vocab().values()) == list(range(4096))
    assert all(wide.convert_ids_to_tokens(i) == tiny.convert_ids_to_tokens(i) for i in range(512))
    assert wide.eos_token_id == tiny.eos_token_id and wide.chat_template == tiny.chat_template
    new_ids = range(512, 4096)
    assert all(wide.decode([i]).strip() for i in new_ids)  # every new id is text, not bytes or specials
    text = "The quick brown fox jumps over 12 lazy dogs, twice."
    ids = wide.encode(text)
    assert wide.decode(ids) == text and any(i >= 512 for i in ids)  # the new merges apply
    with pytest.raises(ValueError, match="fewer than"):
        load_tiny_tokenizer(100)


def test_chat_template(tiny_model_dir: TinyDir) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, tokenize=False) == text.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert ids[0] == IM_START and ids[-1] == tok.encode("\n", add_special_tokens=False)[-1]


def test_demo_model_ships_small_with_a_printable_tokenizer() -> None:
    """The default model is a trained Llama under 2 MB whose every token renders as printable text (or a
    newline): a character BPE, no byte-level alphabet whose lone bytes would print as control characters."""
    model_dir = default_model_dir()
    assert (model_dir / "model.safetensors").stat().st_size <= 2 * 1024 * 1024
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    for tid in range(len(tok)):
        if tid not in special:
            text = tok.decode([tid])
            assert text and all(ch.isprintable() or ch == "\n" for ch in text), (tid, text)
    msgs = [{"role": "user", "content": "Hello!"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == text  # the template's text round-trips through the tokenizer


def _last_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0, -1]


@pytest.mark.parametrize(
    ("family", "neutral"),
    [
        ("mistral", {"sliding_window": 4096}),
        ("gemma2", {"sliding_window": 4096}),
        ("gemma3", {"sliding_window": 4096}),
        ("llama", {"rope_scaling": None, "rope_theta": 500000.0}),
    ],
)
def test_window_and_rope_scaling_change_outputs(
    family: str, neutral: dict[str, object], tiny_model_dir: TinyDir
) -> None:
    # Same weights; only the feature under test is switched off. 48 tokens > window 32.
    ids = torch.arange(48).unsqueeze(0) * 7 % 500
    on, off = _load(tiny_model_dir(family)), _load(tiny_model_dir(family, **neutral))
    assert not torch.allclose(_last_logits(on, ids), _last_logits(off, ids), atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_is_decisive_and_varied(family: str, tiny_model_dir: TinyDir) -> None:
    # Regression guard for the init scales in factory._reinit (figures measured over 12 prompts x 32
    # steps are in its comments). The weights are fixed, so this is deterministic, not a flaky statistic.
    path = tiny_model_dir(family)
    tok, model = AutoTokenizer.from_pretrained(path), _load(path)
    gaps: list[float] = []
    for prompt in ("The lighthouse keeper counted the gulls", "def fibonacci(n: int) -> list[int]:"):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        kwargs = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, pad_token_id=EOT, **kwargs)
        for step in out.logits:
            top = torch.topk(step[0].double(), 2).values
            gaps.append(float((top[0] - top[1]) / top.abs().max()))
        assert len(set(out.sequences[0, ids.shape[1] :].tolist())) >= 8
    assert min(gaps) > 1e-5
    assert sum(g < 1e-3 for g in gaps) <= 1
