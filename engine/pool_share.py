"""The KV pool's page count on a GPU, from free memory, and the share of it a second engine on the same
device takes: a draft model (speculative decoding) loads after the target has sized its pool, and its
own pool has the target's page count, so the target must leave room for both before it allocates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig

MIN_PAGES = 64  # fewer than this is no cache to serve from: an error, not a pool


@dataclass(frozen=True)
class PoolShare:
    """What another engine beside this one needs: its weights (`reserved_bytes`, an upper bound) and a
    KV pool of this engine's page count, `kv_elements_per_token` per token (at this pool's element
    size: the draft inherits `kv_cache_dtype`)."""

    reserved_bytes: int
    kv_elements_per_token: int

    @classmethod
    def of_model(cls, model_dir: Path, tp_size: int, dtype: torch.dtype, dummy: bool) -> PoolShare:
        """The share of the model in `model_dir` on one of `tp_size` ranks. Its weights are its
        safetensors files' size, whole (a rank holds less: the bound errs towards a smaller target
        pool, never an out-of-memory); with `dummy` weights (no files) a count from its config."""
        mc = ModelConfig.from_dir(model_dir)
        files = list(model_dir.glob("*.safetensors"))
        if dummy or not files:
            reserved = _parameter_count(mc) * torch.empty((), dtype=dtype).element_size()
        else:
            reserved = sum(f.stat().st_size for f in files)
        return cls(reserved, _kv_elements_per_token(mc, tp_size))


def kv_pages(
    free: int, total: int, mem_fraction: float, page_size: int, token_bytes: int, element_size: int,
    share: PoolShare | None,
) -> int:  # fmt: skip
    """Pages of `page_size` tokens, `token_bytes` each, in what `mem_fraction` of `total` leaves of `free`
    (bytes, after this engine's weights); with `share`, less its weights, and each page also paying for
    its page of the same tokens at `element_size` bytes an element."""
    budget = free - (1.0 - mem_fraction) * total
    per_page = token_bytes * page_size
    beside = ""
    if share is not None:
        budget -= share.reserved_bytes
        per_page += share.kv_elements_per_token * element_size * page_size
        beside = f" and reserving {share.reserved_bytes / 2**30:.2f} GiB for the draft's weights"
    if budget < per_page * MIN_PAGES:
        raise RuntimeError(
            f"not enough GPU memory for the KV cache after loading weights{beside}: "
            f"{max(0.0, budget) / 2**30:.2f} GiB left at mem_fraction={mem_fraction}"
        )
    return int(budget // per_page) - 1  # one dummy page per group (KVPool)


def _kv_elements_per_token(mc: ModelConfig, tp_size: int) -> int:
    """K and V elements a token takes in the pool over all layers on one rank: KV heads are split over
    the ranks, each rank keeping at least one (a model with fewer KV heads than ranks replicates them);
    latent attention keeps one latent and one rope key a token."""
    if mc.mla is not None:
        return mc.num_layers * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim)
    heads = max(1, mc.num_kv_heads // tp_size)
    return mc.num_layers * heads * 2 * mc.head_dim


def _parameter_count(mc: ModelConfig) -> int:
    """A transformer's parameters from its config: embeddings (and an untied head), attention with its
    biases and q/k norms, a gated MLP (routed experts in full where the config has them) and the norms."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    attention = 2 * h * q + 2 * h * kv
    attention += (q + 2 * kv) * mc.attention_bias + 2 * mc.head_dim * mc.qk_norm
    experts = mc.moe.num_experts if mc.moe is not None else 1
    mlp = 3 * h * mc.intermediate_size * experts
    embeddings = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return embeddings + mc.num_layers * (attention + mlp + 2 * h) + h
