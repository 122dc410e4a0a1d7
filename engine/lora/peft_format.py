"""A PEFT LoRA adapter on disk (`adapter_config.json` and `adapter_model.safetensors`), read and checked
against the base model's shapes before any of its weights are used.

What tandem applies: low-rank deltas `scale * B @ A` on the q/k/v/o/gate/up/down projections of the
decoder layers, at any rank up to `max_lora_rank`, with `lora_alpha`, `use_rslora`, `rank_pattern` and
`alpha_pattern` (PEFT's per-module overrides, matched as PEFT matches them) and `layers_to_transform`
(the tensors present decide which layers carry a delta). Everything else PEFT can express that changes the
model (DoRA, `modules_to_save`, biases, embedding or LM-head adapters, layer replication, LoRA variants)
is refused here, with the field or tensor named, so an adapter is never served as a silently different
model. Fields that only steer training or initialisation are accepted as they are.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tandem.engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections tandem applies deltas to, and the block of the decoder layer each belongs to.
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Fields read here, or that only steer training and initialisation (so a saved adapter is a plain LoRA).
_UNDERSTOOD = {
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "bias",
    "fan_in_fan_out",
    "modules_to_save",
    "init_lora_weights",
    "lora_dropout",
    "base_model_name_or_path",
    "revision",
    "task_type",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "megatron_core",
    "runtime_config",
    "qalora_group_size",
    "ensure_weight_tying",
}
# init_lora_weights values that make the saved layers a different computation (a LoRA variant).
_VARIANT_INITS = ("mica",)
# `...layers.<i>.<block>.<proj>.lora_<A|B>[.<adapter name>].weight`, with any module prefix before it.
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>(?:\w+\.)*?)layers\.(?P<layer>\d+)\.(?P<block>\w+)\."
    r"(?P<proj>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter tandem cannot serve exactly; the message names the adapter and what is wrong."""


@dataclass(frozen=True)
class LoraModule:
    """The delta of one projection of one layer: `scale * B @ A`, A [rank, in] and B [out, rank]."""

    layer: int
    proj: str  # a key of PROJECTIONS
    rank: int
    scale: float
    a_name: str  # tensor names in the weights file
    b_name: str


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter: its modules (which tensors, at which rank and scale); weights are read later."""

    path: Path
    weights: Path
    rank: int  # the largest module rank
    modules: tuple[LoraModule, ...]


def projection_shape(model: ModelConfig, proj: str) -> tuple[int, int]:
    """(out, in) features of a projection of the base model, as its full (unsharded) weight has them."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[proj]


def read_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> PeftAdapter:
    """Read and check the adapter at `path` (a local directory) for `model`; AdapterError if tandem cannot
    serve it as PEFT would. Reads the config and the tensors' shapes, not their values."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    config_file = root / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        extra = (
            " (adapter_model.bin is not read: save it with safe_serialization)"
            if (root / "adapter_model.bin").is_file()
            else ""
        )
        raise AdapterError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE}{extra}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} must hold a JSON object")
    _check_config(config, config_file)
    shapes = _tensor_shapes(weights)
    modules = _modules(config, shapes, model, root)
    if not modules:
        raise AdapterError(f"LoRA adapter {str(path)!r} has no lora_A/lora_B tensors of q/k/v/o/gate/up/down")
    rank = max(m.rank for m in modules)
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {str(path)!r} has rank {rank}, above max_lora_rank={max_rank}")
    return PeftAdapter(root, weights, rank, tuple(modules))


def _check_config(config: dict[str, Any], where: Path) -> None:
    def refuse(field: str, why: str) -> AdapterError:
        return AdapterError(f"{where}: {field}={config.get(field)!r}: {why}")

    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise refuse("peft_type", "only LoRA adapters are served")
    if config.get("bias", "none") != "none":
        raise refuse("bias", "adapters with trained biases are not applied; tandem serves bias='none'")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out", "transposed (Conv1D) weights are not applied")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", "fully trained modules are not applied; only LoRA deltas are")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(_VARIANT_INITS):
        raise refuse("init_lora_weights", "this LoRA variant is not applied")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            leaf = str(name).rsplit(".", 1)[-1]
            if leaf in ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out"):
                raise refuse("target_modules", f"{name!r}: embedding and LM-head adapters are not applied")
    for key, value in config.items():
        if key not in _UNDERSTOOD and value:
            raise refuse(key, "tandem does not apply this PEFT option")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key, 8), int | float) or config.get(key, 8) <= 0:
            raise refuse(key, "must be a positive number")


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as handle:
            return {
                name: tuple(int(d) for d in handle.get_slice(name).get_shape())
                for name in handle.keys()  # noqa: SIM118 - safe_open handles are not iterable
            }
    except Exception as exc:  # a truncated or foreign file fails with anything
        raise AdapterError(f"{weights} is not a readable safetensors file: {exc}") from None


def pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """The key of `patterns` (rank_pattern / alpha_pattern) that applies to `module`, as PEFT picks it:
    the first key that matches the end of the module's name at a dot."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _modules(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], model: ModelConfig, root: Path
) -> list[LoraModule]:
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora", False))
    layers = config.get("layers_to_transform")
    allowed = None if layers is None else ({layers} if isinstance(layers, int) else set(layers))
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    names: dict[tuple[int, str], str] = {}
    for name in shapes:
        match = _KEY.match(name)
        if match is None or PROJECTIONS.get(match["proj"]) != match["block"]:
            raise AdapterError(
                f"{root / WEIGHTS_FILE}: tensor {name!r} is not a LoRA A or B weight of a "
                "q/k/v/o/gate/up/down projection; tandem applies nothing else"
            )
        layer = int(match["layer"])
        if layer >= model.num_layers:
            raise AdapterError(
                f"{root / WEIGHTS_FILE}: tensor {name!r} is for layer {layer}, but the base "
                f"model has {model.num_layers} layers"
            )
        if allowed is not None and layer not in allowed:
            raise AdapterError(f"{root / WEIGHTS_FILE}: tensor {name!r} is outside layers_to_transform")
        if match["block"] == "mlp" and model.moe is not None and model.moe.is_sparse(layer):
            raise AdapterError(
                f"{root / WEIGHTS_FILE}: tensor {name!r} adapts layer {layer}'s {match['proj']}, a "
                "mixture-of-experts layer: tandem applies adapters to attention and dense MLPs only"
            )
        key = (layer, match["proj"])
        pairs.setdefault(key, {})[match["ab"]] = name
        names[key] = f"{match['prefix']}layers.{layer}.{match['block']}.{match['proj']}"
    modules = []
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{root / WEIGHTS_FILE}: layer {layer} {proj} has no {missing} tensor")
        out_features, in_features = projection_shape(model, proj)
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or a[0] != b[1]:
            raise AdapterError(
                f"{root / WEIGHTS_FILE}: layer {layer} {proj} has lora_A {list(a)} and lora_B {list(b)}, but "
                f"the base model's {proj} is {out_features} x {in_features} (A [r, {in_features}], "
                f"B [{out_features}, r]): an adapter for another model?"
            )
        module = names[(layer, proj)]
        rank_key, alpha_key = pattern_key(rank_pattern, module), pattern_key(alpha_pattern, module)
        want = rank_pattern[rank_key] if rank_key is not None else r
        if a[0] != want:
            raise AdapterError(
                f"{root / WEIGHTS_FILE}: layer {layer} {proj} has rank {a[0]}, but "
                f"adapter_config.json gives it r={want}"
            )
        module_alpha = alpha_pattern[alpha_key] if alpha_key is not None else alpha
        scale = module_alpha / (math.sqrt(a[0]) if rslora else a[0])
        modules.append(LoraModule(layer, proj, a[0], float(scale), ab["A"], ab["B"]))
    return modules
