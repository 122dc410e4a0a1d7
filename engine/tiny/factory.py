"""Write complete, tiny, random-weight HF model directories for each supported family.

The models are used by tests that compare our engine token-for-token against transformers, so the weights
are re-initialised (see `_reinit`) to give peaked, decisive logits: with the near-flat logits of a stock
random init, the two implementations' different float32 summation orders would flip greedy choices.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from .tokenizer import (
    EOS_TOKEN,
    IM_END_TOKEN,
    MODEL_MAX_LENGTH,
    load_harmony_tokenizer,
    load_tiny_tokenizer,
    special_token_ids,
)

FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
)
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# Latent attention (MLA) and grouped routing; apart from FAMILIES, whose shape (q/k/v heads) tests check.
MLA_FAMILIES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "gpt_oss": GptOssConfig,
    "deepseek_v2": DeepseekV2Config,
    "deepseek_v3": DeepseekV3Config,
}

# Gemma's RMSNorm multiplies by (1 + weight); everyone else multiplies by weight.
_OFFSET_NORM_FAMILIES = frozenset({"gemma2", "gemma3"})

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
}

# Rope is given in the legacy `rope_theta`/`rope_scaling` form: transformers 5.x folds it into
# `rope_parameters` (what lands in config.json), and 4.x reads it natively. The bases differ per family on
# purpose, so an engine that hard-codes 10000 is caught.
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_theta": 500000.0,
        # Llama-3.1 scaling with a tiny original context, so all three frequency bands (kept, smoothed,
        # divided by `factor`) occur for head_dim 16 and the scaling matters at short lengths.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": True,
    },
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": False},  # q/k/v bias is built into Qwen2
    "qwen3": {"rope_theta": 1000000.0, "tie_word_embeddings": True},  # q/k RMSNorm is built into Qwen3
    "mistral": {"rope_theta": 10000.0, "sliding_window": 32, "tie_word_embeddings": False},
    "gemma2": {
        "rope_theta": 10000.0,
        "sliding_window": 32,  # default layer_types alternate sliding/full
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "num_hidden_layers": 6,  # default 5:1 sliding/full pattern -> layer 5 is global
        "sliding_window": 32,
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
        # rope: the config class's defaults (sliding 10000, full 1e6).
    },
    # Eight experts each, so a short decode batch leaves most of them without a token. Mixtral's experts
    # take `intermediate_size`; the Qwen families' dense layers (`mlp_only_layers`) do, their experts
    # `moe_intermediate_size`. Qwen3-MoE's top 3 is not a power of two, on purpose.
    "mixtral": {"rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "rope_theta": 1000000.0,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "rope_theta": 1000000.0,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [2],
        "tie_word_embeddings": True,
    },
    # gpt-oss: sliding and full layers alternating (the config's default layer_types), a small window,
    # YaRN over a tiny original context so the ramp's three bands occur for head_dim 16, top 2 of 8.
    "gpt_oss": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        "sliding_window": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
    },
}

# DeepSeek: 8 experts in 4 groups of which 2 compete, after one dense layer, beside a shared expert.
# V2-Lite's shape (a plain query projection, softmax scores, unnormalized weights); V3's (a low-rank
# query, sigmoid scores with a correction bias, renormalized, YaRN with both mscales, so the cos/sin
# factor and the softmax scale both differ from 1).
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
}
_FAMILY["deepseek_v2"] = {
    **_MLA,
    "rope_theta": 10000.0,
    "q_lora_rank": None,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "topk_method": "group_limited_greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 2.0,
}
_FAMILY["deepseek_v3"] = {
    **_MLA,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": MODEL_MAX_LENGTH // 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "q_lora_rank": 32,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}

_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq")


def _check_family(family: str) -> None:
    if family not in FAMILIES + MLA_FAMILIES:
        known = ", ".join(FAMILIES + MLA_FAMILIES)
        raise ValueError(f"unknown tiny model family {family!r}; supported families: {known}")


def tiny_config(family: str, **config_overrides: Any) -> PretrainedConfig:
    """The transformers config `make_tiny_model` would write, before weights exist."""
    return _build_config(family, family_tokenizer(family), config_overrides)


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer a family's models ship: gpt-oss's has the harmony markers too (521 ids), since a
    gpt-oss model is only served in the harmony format; every other family's is the 512-id ChatML one."""
    return load_harmony_tokenizer() if family == "gpt_oss" else load_tiny_tokenizer()


def _build_config(
    family: str, tokenizer: PreTrainedTokenizerFast, config_overrides: dict[str, Any]
) -> PretrainedConfig:
    _check_family(family)
    ids = special_token_ids(tokenizer)
    eos, im_end = ids[EOS_TOKEN], ids[IM_END_TOKEN]
    kwargs: dict[str, Any] = {
        **_COMMON,
        **_FAMILY[family],
        "vocab_size": len(tokenizer),
        # No BOS is ever prepended; like Qwen, point bos at <|endoftext|> so generate() has a valid id.
        "bos_token_id": eos,
        "eos_token_id": [eos, im_end],
        "pad_token_id": eos,
    }
    if family in MLA_FAMILIES:
        kwargs.pop("head_dim")  # the config sets it to qk_rope_head_dim, the rope's width
    if "rope_parameters" in config_overrides:
        # New-style rope wins over legacy keys inside transformers, so drop ours to avoid a silent merge.
        for key in _ROPE_KEYS:
            kwargs.pop(key, None)
    kwargs.update(config_overrides)
    return _CONFIG_CLASSES[family](**kwargs)


# Init scales (see `_reinit`), tuned by greedy-decoding 12 prompts x 32 steps per family in float32/eager:
# top-1 vs top-2 logit gap, relative to |top-1|, is < 1e-3 on 0.5-1% of steps (median ~0.07, never
# < 2e-5 seen), 25-30 distinct tokens per 32-token generation, median top-1 probability ~0.2; HF eager and
# sdpa produce identical 64-token greedy outputs for all 12 prompts (max logit diff ~1e-4).
_LINEAR_GAIN = 2.0  # linear weights ~ N(0, (gain / sqrt(fan_in))^2)
_EMBED_STD = 0.1
_GEMMA_EMBED_STD = 0.02  # Gemma multiplies embeddings by sqrt(hidden_size) = 8
_BIAS_STD = 0.5
_NORM_JITTER = 0.1  # relative spread of norm weights around their centre
_QK_NORM_CENTRE = 2.0  # sharper attention for q/k-normed families (qwen3, gemma3); else they loop early
_SCORE_BIAS_STD = 0.1
_TARGET_LOGIT_STD = 2.5  # set via the final norm, so sampling is not near-uniform noise


@torch.no_grad()
def _reinit(model: PreTrainedModel, family: str, seed: int) -> None:
    """Re-draw every weight from a private generator, in name order, at scales that give peaked logits.

    A private generator keeps the weights independent of transformers' own init code (which changes
    between versions). Linear weights are large enough that every layer matters and generations vary;
    embeddings are small so the layers dominate the residual stream (otherwise a tied-embedding model
    just predicts its input token back). Norm weights are jittered around their centre so a missing or
    mis-applied weight (Gemma stores w and applies 1 + w) changes outputs; the final norm's centre sets
    the overall logit scale.
    """
    gen = torch.Generator().manual_seed(seed)
    offset_norm = family in _OFFSET_NORM_FAMILIES
    embed_std = _GEMMA_EMBED_STD if offset_norm else _EMBED_STD
    hidden = int(model.config.hidden_size)
    final_centre = _TARGET_LOGIT_STD / (embed_std * math.sqrt(hidden))
    found_final_norm = False
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("sinks"):
            # Sinks near e^2 keys' worth of mass: at every context length in the tests they move each
            # head's output by tens of percent, so a path that drops or misapplies them cannot pass
            # as rounding noise (small sinks fade to nothing once a row has a few dozen keys).
            value = 2.0 + noise
        elif name.endswith("bias"):  # gpt-oss's experts' biases are 2-D
            value = noise * _BIAS_STD
        elif param.ndim >= 2 and ("embed" in name or "lm_head" in name):
            value = noise * embed_std
        elif family == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            value = noise * (_LINEAR_GAIN / math.sqrt(param.shape[-2]))  # gpt-oss's [E, in, out]
        elif param.ndim >= 2:
            value = noise * (_LINEAR_GAIN / math.sqrt(param.shape[-1]))
        else:  # RMSNorm weight
            if name == "model.norm.weight":
                centre, found_final_norm = final_centre, True
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                centre = _QK_NORM_CENTRE
            else:
                centre = 1.0
            value = centre * (1.0 + _NORM_JITTER * noise) - (1.0 if offset_norm else 0.0)
        param.copy_(value.to(param.dtype))
    for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: moves the choice, not the weights
            noise = torch.randn(buffer.shape, generator=gen, dtype=torch.float32)
            buffer.copy_(noise * _SCORE_BIAS_STD)
    if not found_final_norm:
        raise RuntimeError(f"{type(model).__name__} has no model.norm.weight; the logit scale is unset")


def make_tiny_model(
    path: str | os.PathLike[str], family: str = "qwen3", *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a complete HF model directory (config, float32 safetensors, generation config, tokenizer with
    chat template) for `family` into `path` and return it. `config_overrides` replace config fields."""
    _check_family(family)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = family_tokenizer(family)
    config = _build_config(family, tokenizer, config_overrides)
    # Seeded for the spec, but forked so the caller's global RNG stream is left untouched; the weights that
    # matter come from `_reinit`'s private generator anyway.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.float32)
    _reinit(model, family, seed)
    ids = special_token_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[EOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[EOS_TOKEN],
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_model_dir() -> Path:
    """The demo model that `tandem serve` serves with no `--model`: a two-layer Llama trained on the
    bundled corpus (scripts/train_demo_model.py), shipped in the package, so its answers are words."""
    return DEMO_MODEL_DIR
