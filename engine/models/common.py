"""The decoder blocks shared by every family; a family file only states what differs."""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import FusedDecode, LayerSpec
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.kv_pool import KVPool
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_shard,
    head_shard,
)
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.layers.source import TensorSource
from tandem.engine.models.context import Build, ForwardContext, Traits

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [T, H, D]; k and v [T, Hkv, D]
Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # residual, q, k, v


class Loadable(Protocol):
    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None: ...


class Attention(nn.Module):
    def __init__(self, b: Build, layer_id: int) -> None:
        super().__init__()
        c, tp = b.config, b.tp
        q_shard = head_shard(c.num_heads, c.head_dim, tp)
        kv_shard = head_shard(c.num_kv_heads, c.head_dim, tp)
        self.qkv_proj = b.column(c.hidden_size, [q_shard, kv_shard, kv_shard], bias=c.attention_bias)
        self.o_proj = b.row(c.num_heads * c.head_dim, c.hidden_size)
        self.q_norm = b.norm(c.head_dim) if c.qk_norm else None
        self.k_norm = b.norm(c.head_dim) if c.qk_norm else None
        window = c.window_of(layer_id)
        self.rotary = RotaryEmbedding(
            c.rope if window is None else c.rope_local, c.head_dim, b.device, b.kernels
        )
        self.spec = LayerSpec(
            layer_id=layer_id,
            num_heads=q_shard.size // c.head_dim,
            num_kv_heads=kv_shard.size // c.head_dim,
            head_dim=c.head_dim,
            scale=c.attn_scale,
            window=window,
            softcap=c.attn_softcap,
        )
        # On CUDA, the per-head norms (where the model has them) and the rope in one Triton launch
        # when the rope covers the whole head; that launch can also store K/V (`stores_kv`).
        table = self.rotary.table
        self.fused_qk = (
            b.kernels is not None
            and b.kernels.qk_norm_rope is not None
            and table is not None
            and table.shape[-1] == c.head_dim
            and c.head_dim & (c.head_dim - 1) == 0  # the kernel's blocks span half a head
        )
        self.kernels = b.kernels

    def stores_kv(self, ctx: ForwardContext | None) -> bool:
        """Whether `qkv` under `ctx` writes this step's K/V into the pool itself, so attention must not:
        with the fused launch, where the backend hands over the new tokens' slots."""
        return self._store(ctx) is not None

    def _store(self, ctx: ForwardContext | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k cache, v cache, slots) for the fused launch's K/V store under `ctx`, or None."""
        if ctx is None or not self.fused_qk:
            return None
        layer = self.spec.layer_id
        slots = ctx.attention.new_kv_slots(ctx.pool.layer_group[layer])
        return None if slots is None else (ctx.pool.k[layer], ctx.pool.v[layer], slots)

    def _fused(
        self,
        merged: torch.Tensor,
        positions: torch.Tensor,
        store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The one Triton launch: the q/k norms where the layer has them, the rope, and with `store`
        (k cache, v cache, slots) the K/V store."""
        assert self.kernels is not None and self.kernels.qk_norm_rope is not None
        assert self.rotary.table is not None
        s, q_norm, k_norm = self.spec, self.q_norm, self.k_norm
        return self.kernels.qk_norm_rope(
            merged,
            positions,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            self.rotary.table,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            eps=0.0 if q_norm is None else q_norm.eps,
            gemma=q_norm is not None and q_norm.gemma,
            kv_cache=store,
        )

    def warm_up_store(self, pool: KVPool) -> None:
        """Build the fused launch's store form for eager batches (their own int64 slots) now, at start:
        otherwise the first eager batch, a long prefill, would wait on a Triton build. It writes one
        token of zeros into the group's dummy page, which no request owns."""
        if not self.fused_qk or pool.fp8:  # an FP8 pool is written by the backend's store only
            return
        layer = self.spec.layer_id
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        slot = pool.dummy_page(pool.layer_group[layer]) * pool.page_size
        merged = k_cache.new_zeros(1, sum(self.qkv_proj.output_sizes))
        slots = torch.full((1,), slot, dtype=torch.int64, device=k_cache.device)
        self._fused(merged, torch.zeros_like(slots), (k_cache, v_cache, slots))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the layer's normed input to the attention output [T, H * D], before the o projection."""
        group = ctx.pool.layer_group[self.spec.layer_id]
        # The plan picks the route: the one launch (where this layer's KV group is served), else the
        # q/k/v step (storing K/V itself where it can) and the backend's attention.
        fused = ctx.attention.fused_decode(group) if ctx.plan.fused_decode and self.fused_qk else None
        if fused is not None:
            return self._fused_decode(self.qkv_proj(x, ctx.plan), positions, ctx, fused)
        q, k, v = self.qkv(positions, x, ctx.plan, ctx)
        return ctx.attention.forward(self.spec, q, k, v, ctx.pool, stored=self.stores_kv(ctx))

    def _fused_decode(
        self, merged: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, fused: FusedDecode
    ) -> torch.Tensor:
        """A small decode graph's one launch: norms, rope, K/V store, attention and merge."""
        assert self.kernels is not None and self.kernels.decode_rope_attention is not None
        assert self.rotary.table is not None
        s, q_norm, k_norm, layer = self.spec, self.q_norm, self.k_norm, self.spec.layer_id
        return self.kernels.decode_rope_attention(
            merged,
            positions,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            self.rotary.table,
            (ctx.pool.k[layer], ctx.pool.v[layer]),
            fused.pages,
            fused.old_lens,
            fused.slots,
            fused.scratch,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            eps=0.0 if q_norm is None else q_norm.eps,
            gemma=q_norm is not None and q_norm.gemma,
            scale=s.scale,
            page_size=fused.page_size,
            splits=fused.splits,
            block_n=fused.block_n,
            pdl=ctx.plan.pdl,
        )

    def qkv(
        self, positions: torch.Tensor, x: torch.Tensor, plan: KernelPlan, ctx: ForwardContext | None = None
    ) -> QKV:
        """Everything before the attention kernel: projection, per-head norms and rope; with `ctx`,
        also the K/V store where `stores_kv(ctx)` (k then comes back as the layer's K cache)."""
        s = self.spec
        merged = self.qkv_proj(x, plan)
        q, k, v = merged.split(self.qkv_proj.output_sizes, dim=-1)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.fused_qk:
            q, k = self._fused(merged, positions, self._store(ctx))
            return q, k, v
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, b: Build) -> None:
        super().__init__()
        c = b.config
        shard = even_shard(c.intermediate_size, b.tp)
        self.gate_up_proj = b.column(c.hidden_size, [shard, shard], bias=False)
        self.down_proj = b.row(c.intermediate_size, c.hidden_size)
        self.gelu = c.hidden_act.startswith("gelu")
        self.kernels = b.kernels

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER) -> torch.Tensor:
        merged = self.gate_up_proj(x, plan)
        if self.kernels is not None:
            return self.down_proj(self.kernels.act_and_mul(merged, gelu=self.gelu, plan=plan), plan)  # type: ignore[no-any-return]
        gate, up = merged.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up, plan)  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, b: Build, layer_id: int) -> None:
        super().__init__()
        size = b.config.hidden_size
        self.self_attn = Attention(b, layer_id)
        self.mlp = MLP(b)
        self.input_layernorm = b.norm(size)
        self.post_attention_layernorm = b.norm(size)
        self.sandwich = b.traits.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = b.norm(size)
            self.post_feedforward_layernorm = b.norm(size)

    def finish(
        self, x: torch.Tensor, attn_out: torch.Tensor, next_norm: RMSNorm, plan: KernelPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer once attention has run, then the next norm: (residual, normed).

        Every residual add is fused with the norm that follows it (`RMSNorm.add`), so `x`, the residual
        stream, may be updated in place; `next_norm` is the next layer's input norm or the final norm.
        """
        attn = self.self_attn.o_proj(attn_out, plan)
        if self.sandwich:
            h, x = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(attn, plan), x, plan)
            mlp_out = self.post_feedforward_layernorm(self.mlp(h, plan), plan)
        else:
            h, x = self.post_attention_layernorm.add(attn, x, plan)
            mlp_out = self.mlp(h, plan)
        h, x = next_norm.add(mlp_out, x, plan)
        return x, h


class DecoderBody(nn.Module):
    """Embedding, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, b: Build) -> None:
        super().__init__()
        c = b.config
        self.embed_tokens = VocabParallelEmbedding(
            c.vocab_size, c.hidden_size, b.tp, dtype=b.dtype, device=b.device
        )
        self.layers = nn.ModuleList(DecoderLayer(b, i) for i in range(c.num_layers))
        self.norm = b.norm(c.hidden_size)
        # Gemma scales by sqrt(hidden) rounded to the activation dtype, as upstream does.
        self.embed_scale = (
            torch.tensor(c.hidden_size**0.5, dtype=b.dtype).item() if b.traits.embed_scale else None
        )

    def layer(self, i: int) -> DecoderLayer:
        return cast(DecoderLayer, self.layers[i])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    # The pieces between attention calls, for the piecewise CUDA graphs: each piece is captured per
    # token bucket and attention runs eagerly between them. They run the same modules in the same order
    # as `forward`, so only attention metadata stays outside every graph. They take no ForwardContext:
    # a captured piece must not bake in one batch's K/V slots, so attention stores K/V there.
    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: KernelPlan) -> Piece:
        """Embedding, then layer 0 up to its attention: (residual, q, k, v)."""
        x = self.embed(input_ids)
        layer = self.layer(0)
        return (x, *layer.self_attn.qkv(positions, layer.input_layernorm(x, plan), plan))

    def middle_piece(
        self, i: int, positions: torch.Tensor, x: torch.Tensor, attn_out: torch.Tensor, plan: KernelPlan
    ) -> Piece:
        """Finish layer i - 1 from its attention output, then run layer i up to its attention."""
        layer = self.layer(i)
        x, h = self.layer(i - 1).finish(x, attn_out, layer.input_layernorm, plan)
        return (x, *layer.self_attn.qkv(positions, h, plan))

    def last_piece(self, x: torch.Tensor, attn_out: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        """Finish the last layer, then the final norm."""
        return self.layer(len(self.layers) - 1).finish(x, attn_out, self.norm, plan)[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Eager batches and decode graphs: attention in line (Attention.forward), where the q/k/v step
        may store K/V itself and a small decode graph runs rope, store and attention as one launch."""
        x = self.embed(input_ids)
        h: torch.Tensor = self.layer(0).input_layernorm(x, ctx.plan)
        last = len(self.layers) - 1
        for i in range(last + 1):
            layer = self.layer(i)
            next_norm = self.norm if i == last else self.layer(i + 1).input_layernorm
            x, h = layer.finish(x, layer.self_attn(positions, h, ctx), next_norm, ctx.plan)
        return h


MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class CausalLM(nn.Module):
    """A decoder-only LM. Subclasses set `traits`; everything else comes from the config."""

    traits = Traits()

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        b = Build(config, self.traits, tp, dtype, device, kernels)
        self.model = DecoderBody(b)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, tied=config.tie_word_embeddings)
        # What compute_logits returns: the LM head's own dtype, so the sampler's one-pass race reads it
        # as it is (a float32 copy of large-vocabulary logits is a costly pass of its own); paths that
        # need float32 make their copy. The final soft-cap's tanh runs in float32.
        # The sampler builds its Triton race for this dtype at start (one kernel per input dtype).
        self.logits_dtype = torch.float32 if config.final_softcap is not None else dtype

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank holds (the KV pool's width)."""
        return self.model.layer(0).self_attn.spec.num_kv_heads

    def warm_up_kv_store(self, pool: KVPool) -> None:
        """Build the fused rope + K/V store launch of every layer that has one (see Attention)."""
        for i in range(len(self.model.layers)):
            self.model.layer(i).self_attn.warm_up_store(pool)

    def linear_layers(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        """Every column- and row-parallel layer (the q/k/v, o, gate/up and down projections)."""
        return [m for m in self.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]

    def layer_specs(self) -> list[LayerSpec]:
        return [self.model.layer(i).self_attn.spec for i in range(len(self.model.layers))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).to(self.logits_dtype)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]

    def loaders(self) -> dict[str, tuple[Loadable, int, bool]]:
        """Checkpoint tensor name -> (module that loads it, shard id, is_bias)."""
        table: dict[str, tuple[Loadable, int, bool]] = {}
        for name, module in self.named_modules():
            if not hasattr(module, "load") or (name == "lm_head" and self.config.tie_word_embeddings):
                continue
            parent, _, leaf = name.rpartition(".")
            for pname, _param in module.named_parameters(recurse=False):
                targets = MERGED.get(leaf, (leaf,))
                for shard_id, hf_leaf in enumerate(targets):
                    key = f"{parent}.{hf_leaf}.{pname}" if parent else f"{hf_leaf}.{pname}"
                    table[key] = (cast(Loadable, module), shard_id, pname == "bias")
        return table
