"""What a hidden-state drafter's head is: one decoder layer (and its norms, its LM head) that reads the
target's hidden states of a position beside the embedding of the token after it, and predicts the token
after that. EAGLE-3 (eagle3.py) and DeepSeek's MTP layer (mtp.py) are two such heads; the runner that
keeps their KV and hidden states in step with the target is hidden_drafter.py."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine.attention.base import LayerSpec
from tandem.engine.config import ModelConfig
from tandem.engine.layers.embedding import VocabParallelEmbedding
from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine.models.attention import Attention
from tandem.engine.models.common import Loadable, gemm_linears, module_loaders
from tandem.engine.models.context import ForwardContext, Traits
from tandem.engine.models.latent_attention import LatentAttention


@dataclass(frozen=True)
class HiddenCapture:
    """Which of the target's hidden states a head reads, per token: the residual streams entering
    `layers` side by side (EAGLE-3), or, with no layers, the final normed hidden state (MTP)."""

    layers: tuple[int, ...] = ()


class DraftHead(nn.Module):
    """A head: `project` turns the target's captured states into the layer's hidden input (once per
    token), `forward` runs the layer at a position from that hidden input and the next token, and returns
    (the residual stream after it, the same normed for the LM head); `propose` is the greedy token of
    the normed state, in the target's ids. A later step feeds the residual stream back as hidden input."""

    capture: HiddenCapture
    traits = Traits()  # the Llama baseline's norms (DeepSeek's too), as `load_format: dummy` draws them
    # (pattern, replacement) rewrites of checkpoint names into the head's, applied in order.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, embed: VocabParallelEmbedding) -> None:
        super().__init__()
        self.config = config
        # The target's embedding unless the head loads its own (`embed_tokens` among its modules):
        # kept out of the module tree so that loading does not ask the checkpoint for it.
        self._shared_embed = [embed]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self, "embed_tokens", None)
        table = own if isinstance(own, VocabParallelEmbedding) else self._shared_embed[0]
        return table(input_ids)  # type: ignore[no-any-return]

    @property
    def attention(self) -> Attention | LatentAttention:
        """The layer's attention block: its LayerSpec sizes the head's KV pool."""
        raise NotImplementedError

    def layer_specs(self) -> list[LayerSpec]:
        return [self.attention.spec]

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        return captured

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def propose(self, normed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        return name

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return False

    def loaders(self, available: Collection[str] = ()) -> dict[str, tuple[Loadable, int, bool]]:
        return module_loaders(self, available)

    def linear_layers(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        return gemm_linears(self)
