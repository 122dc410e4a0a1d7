"""EAGLE-3 heads (`LlamaForCausalLMEagle3`, the public checkpoints as vLLM and SGLang load them).

One Llama decoder layer whose q/k/v projection reads two things side by side: the normed embedding of
the next token and the normed hidden input. That hidden input is `fc` of three of the target's residual
streams (the inputs of layers `eagle_config.eagle_aux_hidden_state_layer_ids`, by default 2, L // 2 and
L - 3 of the target's L) at the first step, and the layer's own residual stream after that. The LM head
covers a reduced vocabulary of `draft_vocab_size` ids, mapped to the target's by `d2t` (target id =
draft id + d2t[draft id]); `t2d`, its inverse as a mask, is not needed for greedy drafts. A checkpoint
without `embed_tokens` uses the target's embedding.

Checkpoint names: `midlayer.*` (or `layers.0.*`), `fc`, `norm`, `lm_head`, `d2t`, `t2d`, and optionally
`embed_tokens`, with or without a `model.` prefix.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.source import TensorSource, check_shape
from tandem.engine.models.attention import Attention
from tandem.engine.models.common import MLP
from tandem.engine.models.context import Build, ForwardContext
from tandem.engine.spec.head import DraftHead, HiddenCapture

# The public heads' name, and vLLM's other name for the same layout.
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_layer_ids(raw: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual streams the head reads, in layer order: the checkpoint's
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L // 2, L - 3)."""
    eagle = raw.get("eagle_config") or {}
    listed = eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = (2, target_layers // 2, target_layers - 3) if listed is None else tuple(int(i) for i in listed)
    if len(set(ids)) != len(ids) or not all(0 <= i < target_layers for i in ids):
        raise ValueError(
            f"eagle_config.eagle_aux_hidden_state_layer_ids must be distinct layers of the target's "
            f"{target_layers}, got {list(ids)}"
            + (" (the default for this depth; list them in the head's config.json)" if listed is None else "")
        )
    return tuple(sorted(ids))


class DraftVocabMap(nn.Module):
    """`d2t`: per draft id, the offset to its target id."""

    offsets: torch.Tensor

    def __init__(self, draft_vocab: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("offsets", torch.zeros(draft_vocab, dtype=torch.int64, device=device))

    def checkpoint_entries(self, name: str, available: Collection[str]) -> dict[str, tuple[Any, int, bool]]:
        return {name: (self, 0, False)}

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        check_shape(source, tuple(self.offsets.shape), "d2t (one offset per draft id)")
        self.offsets.copy_(source.read().to(torch.int64))

    def forward(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.offsets[draft_ids]


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (`midlayer`): a Llama layer whose attention reads 2 x hidden."""

    def __init__(self, b: Build) -> None:
        super().__init__()
        size = b.config.hidden_size
        self.self_attn = Attention(b, 0, in_features=2 * size)
        self.mlp = MLP(b)
        self.input_layernorm = b.norm(size)
        self.hidden_norm = b.norm(size)
        self.post_attention_layernorm = b.norm(size)
        # Some heads were trained with the residual taken after `hidden_norm` (vLLM's option of the name).
        self.norm_before_residual = bool(b.config.raw.get("norm_before_residual", False))


class Eagle3Head(DraftHead):
    checkpoint_renames = ((r"^model\.", ""), (r"^layers\.0\.", "midlayer."))

    def __init__(
        self,
        b: Build,
        embed: VocabParallelEmbedding,
        target_layers: int,
        *,
        own_embed: bool,
        has_d2t: bool,
    ) -> None:
        super().__init__(b.config, embed)
        c, size = b.config, b.config.hidden_size
        raw = c.raw
        if not (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True):
            raise ValueError("eagle_config.use_aux_hidden_state is false: an EAGLE-1 head, not EAGLE-3")
        self.capture = HiddenCapture(aux_layer_ids(raw, target_layers))
        target_hidden = int(raw.get("target_hidden_size") or size)
        self.fc = b.replicated(target_hidden * len(self.capture.layers), size)
        self.midlayer = Eagle3Layer(b)
        self.norm = b.norm(size)
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(
                c.vocab_size, size, b.tp, dtype=b.dtype, device=b.device
            )
        self.draft_vocab = int(raw.get("draft_vocab_size") or c.vocab_size)
        # The head's rows only: a vocab-parallel table of the draft vocabulary, held by the head alone.
        rows = VocabParallelEmbedding(self.draft_vocab, size, b.tp, dtype=b.dtype, device=b.device)
        self.lm_head = ParallelLMHead(rows, tied=True)
        self.d2t = DraftVocabMap(self.draft_vocab, b.device) if has_d2t else None

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        return self.fc(captured)  # type: ignore[no-any-return]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer, plan = self.midlayer, ctx.plan
        embeds = layer.input_layernorm(self.embed(input_ids), plan)
        normed = layer.hidden_norm(hidden, plan)
        residual = normed.clone() if layer.norm_before_residual else hidden
        attn = layer.self_attn(positions, torch.cat([embeds, normed], dim=-1), ctx)
        h, residual = layer.post_attention_layernorm.add(
            layer.self_attn.project_out(attn, plan), residual, plan
        )
        out, residual = self.norm.add(layer.mlp(h, plan), residual, plan)
        return residual, out

    def propose(self, normed: torch.Tensor) -> torch.Tensor:
        ids: torch.Tensor = self.lm_head(normed).argmax(dim=-1)
        return ids if self.d2t is None else self.d2t(ids)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """`t2d` (the target-to-draft mask): greedy drafts map draft ids forward only."""
        return name == "t2d"
