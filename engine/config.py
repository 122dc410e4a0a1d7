"""Model and engine configuration, read from an HF `config.json` and resolved once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.moe.spec import MoESpec, check_expert_split

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one layer type."""

    theta: float
    rope_type: str = "default"  # "default", "llama3", "linear" or "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (layers/yarn.py): the ramp's rotation bounds, whether they are rounded outwards, and the
    # factor cos and sin are multiplied by (None: derived from `factor`, and from DeepSeek's `mscale` /
    # `mscale_all_dim` where both are set, as transformers does). DeepSeek's MLA also scales its
    # softmax by `mscale_all_dim` (LatentAttentionSpec.scale).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True  # round the ramp's ends to whole dimensions

    def yarn_mscale(self, mscale: float = 1.0) -> float:
        """YaRN's magnitude scale for a context stretched by `factor`: 0.1 mscale ln(factor) + 1. Here
        rather than in layers/yarn.py because `LatentAttentionSpec.scale` needs it too."""
        return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class LatentAttentionSpec:
    """DeepSeek-V2/V3's multi-head latent attention (MLA): per token, one latent `kv_c`
    (`kv_lora_rank` wide) and one rope key `k_pe` (`qk_rope_head_dim`) shared by all heads; each head's
    no-rope key and value are `kv_b_proj` of the latent. `q_lora_rank` None: a plain query projection."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoints' rope dims come in (even, odd) pairs
    scale: float  # the softmax scale: qk_head_dim^-0.5, times YaRN's mscale(mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV pool stores per token and layer: kv_c, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_raw(cls, raw: dict[str, Any], rope: RopeConfig) -> LatentAttentionSpec | None:
        if raw.get("kv_lora_rank") is None:
            return None
        if raw.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported with latent attention (kv_lora_rank)")
        q_lora = raw.get("q_lora_rank")
        nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        scale = (nope + rope_dim) ** -0.5
        if rope.rope_type != "default" and rope.mscale_all_dim:
            m = rope.yarn_mscale(rope.mscale_all_dim)
            scale = scale * m * m
        # DeepSeek-V2's checkpoints are always interleaved; V3 says so with `rope_interleave`.
        interleave = raw.get("model_type") == "deepseek_v2" or bool(raw.get("rope_interleave", True))
        return cls(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=interleave,
            scale=scale,
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, independent of the HF config format version."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    rope: RopeConfig  # full-attention layers
    rope_local: RopeConfig  # sliding-window layers (same as `rope` except for Gemma 3)
    sliding_window: int | None = None  # keys in (q - window, q] are visible on SLIDING layers
    attention_bias: bool = False
    qk_norm: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    moe: MoESpec | None = None  # routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE); None for dense models
    mla: LatentAttentionSpec | None = None  # DeepSeek-V2/V3's latent attention; None: q/k/v heads
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return 1.0 / math.sqrt(self.query_pre_attn_scalar)
        return 1.0 / math.sqrt(self.head_dim)

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def has_window_layers(self) -> bool:
        return self.sliding_window is not None and SLIDING in self.layer_types

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        with path.open() as f:
            raw = json.load(f)
        extra_eos = _generation_eos(Path(model_dir))
        return cls.from_dict(raw, extra_eos=extra_eos)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        text = raw.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in raw:
            raw = {**text, "architectures": raw.get("architectures")}
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        model_type = str(raw.get("model_type", ""))
        num_layers = int(raw["num_hidden_layers"])
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        window = raw.get("sliding_window")
        if model_type.startswith("qwen") and not raw.get("use_sliding_window", False):
            window = None
        layer_types = _layer_types(raw, num_layers, model_type, window)
        rope_full, rope_local = _rope_configs(raw, model_type)
        is_gemma = model_type.startswith("gemma")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        eos = _as_ids(raw.get("eos_token_id")) + extra_eos
        return cls(
            architecture=str(archs[0]),
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
            layer_types=layer_types,
            rope=rope_full,
            rope_local=rope_local,
            sliding_window=int(window) if window is not None and SLIDING in layer_types else None,
            attention_bias=_attention_bias(raw, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"),
            attn_softcap=_opt_float(raw.get("attn_logit_softcapping")),
            final_softcap=_opt_float(raw.get("final_logit_softcapping")),
            query_pre_attn_scalar=_opt_float(raw.get("query_pre_attn_scalar")) if is_gemma else None,
            hidden_act=str(act),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            moe=MoESpec.from_raw(raw, num_layers),
            mla=LatentAttentionSpec.from_raw(raw, rope_full),
            raw=raw,
        )


def check_expert_split_of(model_dir: str | Path, tp_size: int, *, expert_parallel: bool) -> None:
    """Raise ValueError now, before any rank starts, if the model's experts cannot be split over
    `tp_size` ranks (a dense model always can)."""
    spec = ModelConfig.from_dir(model_dir).moe
    if spec is not None:
        check_expert_split(spec, tp_size, expert_parallel=expert_parallel)


def _attention_bias(raw: dict[str, Any], model_type: str) -> bool:
    """q/k/v biases: `attention_bias`, or Qwen2-MoE's `qkv_bias`; Qwen2 and Qwen2-MoE have them by default."""
    for key in ("attention_bias", "qkv_bias"):
        if raw.get(key) is not None:
            return bool(raw[key])
    return model_type in ("qwen2", "qwen2_moe")


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    with path.open() as f:
        return _as_ids(json.load(f).get("eos_token_id"))


def _layer_types(raw: dict[str, Any], num_layers: int, model_type: str, window: Any) -> tuple[str, ...]:
    given = raw.get("layer_types")
    if given:
        if len(given) != num_layers:
            raise ValueError(f"layer_types has {len(given)} entries for {num_layers} layers")
        return tuple(SLIDING if t == SLIDING and window is not None else FULL for t in given)
    if window is None:
        return (FULL,) * num_layers
    if model_type == "gemma2":
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    if model_type.startswith("gemma3"):
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    return (SLIDING,) * num_layers  # Mistral: a window on every layer


# The rope base a family's config class assumes when config.json leaves it out.
_DEFAULT_THETA = {"gpt_oss": 150000.0}


def _rope_from(params: dict[str, Any], default_theta: float) -> RopeConfig:
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3, linear, yarn")
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _rope_configs(raw: dict[str, Any], model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """Accept both transformers 5 `rope_parameters` and the older `rope_theta`/`rope_scaling` keys."""
    theta = float(raw.get("rope_theta", _DEFAULT_THETA.get(model_type, 10000.0)))
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full_params: dict[str, Any] = params.get(FULL) or {}
        full = _rope_from(full_params, theta)
        local = _rope_from(params.get(SLIDING) or full_params, theta)
        return full, local
    if isinstance(params, dict):
        full = _rope_from(params, theta)
    else:
        full = _rope_from({"rope_theta": theta, **(raw.get("rope_scaling") or {})}, theta)
    if model_type.startswith("gemma3"):
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
        return full, RopeConfig(theta=local_theta)
    return full, full
