"""The decoder shared by every family; a family file only states what differs. The blocks are put
together here: the MLP, the decoder layer, the body (and its pieces for the piecewise graphs) and the
causal LM with its logits and checkpoint names. The attention block is in attention.py, and what every
module is given, in context.py."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import LayerSpec
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.kv_pool import KVPool
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, even_shard
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.source import TensorSource
from tandem.engine.models.attention import Attention
from tandem.engine.models.context import Build, ForwardContext, Traits
from tandem.engine.models.latent_attention import LatentAttention
from tandem.engine.moe.layer import MoE

Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # residual, q, k, v


class Loadable(Protocol):
    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None: ...


class MLP(nn.Module):
    """The gated MLP; `intermediate_size` other than the config's for an MoE layer's shared expert."""

    def __init__(self, b: Build, intermediate_size: int | None = None) -> None:
        super().__init__()
        c = b.config
        size = c.intermediate_size if intermediate_size is None else intermediate_size
        shard = even_shard(size, b.tp)
        self.gate_up_proj = b.column(c.hidden_size, [shard, shard], bias=False)
        self.down_proj = b.row(size, c.hidden_size)
        self.gelu = c.hidden_act.startswith("gelu")
        self.kernels = b.kernels

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER, *, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: this rank's partial sum, left for the caller's all-reduce."""
        merged = self.gate_up_proj(x, plan)
        if self.kernels is not None:
            act = self.kernels.act_and_mul(merged, gelu=self.gelu, plan=plan)
        else:
            gate, up = merged.chunk(2, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self.down_proj(act, plan, reduce=reduce)  # type: ignore[no-any-return]


def feed_forward(b: Build, layer_id: int) -> nn.Module:
    """The layer's MLP: the MoE block where the model's experts are (moe/layer.py), else a dense MLP."""
    spec = b.config.moe
    if spec is None or not spec.is_sparse(layer_id):
        return MLP(b)
    shared = MLP(b, spec.shared_expert_intermediate_size) if spec.shared_expert_intermediate_size else None
    return MoE(b, spec, shared)


class DecoderLayer(nn.Module):
    def __init__(self, b: Build, layer_id: int) -> None:
        super().__init__()
        size = b.config.hidden_size
        self.self_attn = LatentAttention(b, layer_id) if b.config.mla else Attention(b, layer_id)
        self.mlp = feed_forward(b, layer_id)
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
        attn = self.self_attn.project_out(attn_out, plan)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        capture: tuple[int, ...] = (),
        captured: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Eager batches and decode graphs: attention in line (Attention.forward), where the q/k/v step
        may store K/V itself and a small decode graph runs rope, store and attention as one launch.
        `capture`: layers whose input residual stream is appended to `captured`, in layer order (what
        a hidden-state drafter reads; empty, the default, costs nothing)."""
        x = self.embed(input_ids)
        h: torch.Tensor = self.layer(0).input_layernorm(x, ctx.plan)
        last = len(self.layers) - 1
        for i in range(last + 1):
            if i in capture and captured is not None:
                captured.append(x.clone())  # the next residual add may update x in place
            layer = self.layer(i)
            next_norm = self.norm if i == last else self.layer(i + 1).input_layernorm
            x, h = layer.finish(x, layer.self_attn(positions, h, ctx), next_norm, ctx.plan)
        return h


MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def gemm_linears(module: nn.Module) -> list[ColumnParallelLinear | RowParallelLinear]:
    """Every column- and row-parallel layer (the q/k/v, o, gate/up and down projections), but not MoE
    routers and shared-expert gates: their logits pick the experts, so they keep the model's dtype."""
    routers = {id(m.gate) for m in module.modules() if isinstance(m, MoE)}
    routers |= {id(m.shared_expert_gate) for m in module.modules() if isinstance(m, MoE)}
    # Latent attention reads kv_b_proj's weight as W_UK and W_UV itself (absorbed): no GEMM of its own.
    routers |= {id(m.kv_b_proj) for m in module.modules() if isinstance(m, LatentAttention)}
    return [
        m
        for m in module.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and id(m) not in routers
    ]


class CausalLM(nn.Module):
    """A decoder-only LM. Subclasses set `traits`; everything else comes from the config."""

    traits = Traits()
    # (pattern, replacement) rewrites of checkpoint tensor names into this model's, applied in order
    # (Mixtral's hub names, say); names that no pattern matches are taken as they are.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None = None,
        *,
        expert_parallel: bool = False,
        mxfp4_experts: bool = False,
        fp8_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        b = Build(
            config,
            self.traits,
            tp,
            dtype,
            device,
            kernels,
            expert_parallel=expert_parallel,
            mxfp4_experts=mxfp4_experts,
            fp8_experts=fp8_experts,
        )
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

    @property
    def kv_head_dims(self) -> tuple[int, int]:
        """(K's, V's) width per KV head in the pool; under latent attention (the latent, 0)."""
        spec = self.model.layer(0).self_attn.spec
        return spec.head_dim, spec.stored_v_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """The KV pool's bytes per token over all layers on one rank, at `element_size` bytes each."""
        k_dim, v_dim = self.kv_head_dims
        return len(self.model.layers) * self.local_kv_heads * (k_dim + v_dim) * element_size

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Whether loading skips this checkpoint tensor (after `checkpoint_name`) rather than reject it:
        none by default; families override it for parts they do not run (DeepSeek's MTP layers)."""
        return False

    def warm_up_kv_store(self, pool: KVPool) -> None:
        """Build the fused rope + K/V store launch of every layer that has one (see Attention)."""
        for i in range(len(self.model.layers)):
            self.model.layer(i).self_attn.warm_up_store(pool)

    def linear_layers(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        return gemm_linears(self)

    def layer_specs(self) -> list[LayerSpec]:
        return [self.model.layer(i).self_attn.spec for i in range(len(self.model.layers))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # type: ignore[no-any-return]

    def forward_capturing(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward, and per token the hidden states a drafter reads: the residual streams entering
        `layers` side by side ([T, len(layers) * hidden], EAGLE-3), or with no layers the final normed
        hidden state itself (MTP)."""
        captured: list[torch.Tensor] = []
        hidden = self.model(input_ids, positions, ctx, capture=layers, captured=captured)
        return hidden, torch.cat(captured, dim=-1) if layers else hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, vocab] in `logits_dtype`. `out` ([B, padded vocab], `logits_dtype`): a fixed buffer to
        write them into, as a decode graph does (the result is its view)."""
        cap = self.config.final_softcap
        if cap is None and self.logits_dtype == self.lm_head.weight.dtype:
            return self.lm_head(hidden, out=out)  # type: ignore[no-any-return]
        logits = self.lm_head(hidden).to(self.logits_dtype)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if out is None:
            return logits  # type: ignore[no-any-return]
        return out[:, : logits.shape[1]].copy_(logits)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model's terms (`checkpoint_renames`)."""
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        return name

    def loaders(self, available: Collection[str] = ()) -> dict[str, tuple[Loadable, int, bool]]:
        """Checkpoint tensor name -> (module that loads it, shard id, is_bias). `available`, the
        checkpoint's names (after `checkpoint_name`), picks the layout where a module reads more than one
        (MoE experts: fused or per expert)."""
        skip = ("lm_head",) if self.config.tie_word_embeddings else ()
        return module_loaders(self, available, skip)


def module_loaders(
    root: nn.Module, available: Collection[str] = (), skip: Collection[str] = ()
) -> dict[str, tuple[Loadable, int, bool]]:
    """`CausalLM.loaders` of any module tree (a drafter's head too): every module with `load` reads its
    parameters under their HF names (merged projections split back, `MERGED`), or lists its own
    `checkpoint_entries`; the modules named in `skip` read nothing (a tied LM head)."""
    table: dict[str, tuple[Loadable, int, bool]] = {}
    for name, module in root.named_modules():
        entries = getattr(module, "checkpoint_entries", None)
        if entries is not None:
            table.update(entries(name, available))
            continue
        if not hasattr(module, "load") or name in skip:
            continue
        parent, _, leaf = name.rpartition(".")
        for pname, _param in module.named_parameters(recurse=False):
            targets = MERGED.get(leaf, (leaf,))
            for shard_id, hf_leaf in enumerate(targets):
                key = f"{parent}.{hf_leaf}.{pname}" if parent else f"{hf_leaf}.{pname}"
                table[key] = (cast(Loadable, module), shard_id, pname == "bias")
    return table
