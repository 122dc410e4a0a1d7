"""Checkpoints for the hidden-state drafters' tests: an EAGLE-3 head in the public layout, DeepSeek-V3's
MTP layer appended to a tiny V3, and "repeating" targets (attention and MLP outputs zeroed, the LM head
the embedding) whose greedy tokens repeat the last prompt token, for heads built to agree with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def _config(model_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((model_dir / "config.json").read_text())  # type: ignore[no-any-return]


def repeating(target: Path, out: Path) -> Path:
    """A copy of `target` whose layers add nothing to the residual stream and whose LM head is the
    embedding: each greedy token is the token before it wherever that token's embedding is its own
    nearest (`self_nearest`). Made once per `out`."""
    if out.exists():
        return out
    shutil.copytree(target, out)
    weights = load_file(str(out / WEIGHTS))
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(value)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def self_nearest(model_dir: Path) -> list[int]:
    """The ids whose embedding has the largest dot product with itself among all embeddings."""
    embed = load_file(str(model_dir / WEIGHTS))["model.embed_tokens.weight"].float()
    return torch.nonzero(torch.argmax(embed @ embed.T, dim=1) == torch.arange(len(embed))).flatten().tolist()


def write_eagle3(
    out: Path,
    target: Path,
    *,
    draft_vocab: int,
    keep: list[int],
    seed: int = 0,
    layer_ids: tuple[int, ...] | None = (1, 2, 3),
    own_embed: bool = False,
    agree: bool = False,
    prefix: str = "",
) -> Path:
    """An EAGLE-3 head for `target` in the public layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
    `t2d`): random, or with `agree` one that proposes the token it is given as the hidden state (the
    repeating target's next token). Its draft vocabulary holds `keep` and random other ids."""
    raw = _config(target)
    hidden, vocab = raw["hidden_size"], raw["vocab_size"]
    heads, kv_heads, head_dim = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    inter = raw["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    others = [i for i in torch.randperm(vocab, generator=g).tolist() if i not in keep]
    ids = torch.tensor(sorted(keep + others[: draft_vocab - len(keep)]))
    d2t = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    embed = load_file(str(target / WEIGHTS))["model.embed_tokens.weight"]
    layer = {
        "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "mlp.gate_proj.weight": rand(inter, hidden),
        "mlp.up_proj.weight": rand(inter, hidden),
        "mlp.down_proj.weight": rand(hidden, inter),
        "input_layernorm.weight": torch.ones(hidden),
        "hidden_norm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.ones(hidden),
    }
    width = 3 if layer_ids is None else len(layer_ids)
    fc, head = rand(hidden, width * hidden) * 4, embed[ids].clone() + rand(draft_vocab, hidden) * 0.05
    if agree:  # the hidden input is the token's embedding, and the layer adds nothing to it
        layer["self_attn.o_proj.weight"].zero_()
        layer["mlp.down_proj.weight"].zero_()
        fc = torch.cat([torch.eye(hidden)] + [torch.zeros(hidden, hidden)] * (width - 1), dim=1)
        head = embed[ids].clone()
    tensors = {f"{prefix}midlayer.{k}": v for k, v in layer.items()}
    tensors.update({f"{prefix}fc.weight": fc, f"{prefix}norm.weight": torch.ones(hidden)})
    tensors.update({"lm_head.weight": head, "d2t": d2t, "t2d": t2d})
    if own_embed:
        tensors[f"{prefix}embed_tokens.weight"] = embed.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": raw["rms_norm_eps"],
        "max_position_embeddings": raw["max_position_embeddings"],
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def with_mtp_layer(target: Path, out: Path, *, agree: bool = False, seed: int = 0) -> Path:
    """A copy of a DeepSeek-V3 `target` with one MTP layer appended (`num_nextn_predict_layers: 1`): a
    copy of its last decoder layer, with `enorm`, `hnorm`, `eh_proj`, `shared_head` and the embedding's
    copy. With `agree` the layer passes the next token's embedding through unchanged and predicts with
    the embedding as its head (so it proposes that token: right for a repeating target). Made once per
    `out`."""
    if out.exists():
        return out
    shutil.copytree(target, out)
    weights = load_file(str(out / WEIGHTS))
    raw = _config(out)
    last = raw["num_hidden_layers"]
    below = f"model.layers.{last - 1}."
    g = torch.Generator().manual_seed(seed)
    mine = f"model.layers.{last}."
    extra = {k.replace(below, mine): v.clone() for k, v in weights.items() if k.startswith(below)}
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    eh_proj = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5 * 2
    head = torch.randn(embed.shape, generator=g) * 0.1
    if agree:
        eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        head = embed.clone()
        for name in extra:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                extra[name] = torch.zeros_like(extra[name])
    extra.update(
        {
            f"{mine}enorm.weight": torch.ones(hidden),
            f"{mine}hnorm.weight": torch.ones(hidden),
            f"{mine}eh_proj.weight": eh_proj,
            f"{mine}shared_head.norm.weight": torch.ones(hidden),
            f"{mine}shared_head.head.weight": head,
            f"{mine}embed_tokens.weight": embed.clone(),
        }
    )
    save_file({**weights, **extra}, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    return out
