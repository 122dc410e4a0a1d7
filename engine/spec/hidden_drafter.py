"""A hidden-state drafter on one rank: a draft head (eagle3.py or mtp.py) with its own KV pool and
attention backend, and per request slot the hidden input of the request's next draft step.

The head at position p reads the target's hidden states of p and the token at p + 1, and predicts p + 2.
Its KV pool has one layer, the target's page count and page size, so the scheduler's page tables and
KV slots serve it as they serve the target: a page the target holds for a request holds the head's KV
of the same positions.

- `follow` runs the head over every target batch once its tokens are sampled and stored: each token's
  position gets the target's captured states there and the token after it from the token pool (the
  sampled one for a row's last position). Positions past a row's accepted tokens get wrong inputs, but
  sit past its KV length, so the next row writes them again before they are read. It also keeps, per
  slot, the projected states of the row's last accepted position: the first draft step's hidden input.
- `step` is one draft step over the drafted rows (one token each): step j of a row at length L runs at
  position L - 2 + j, reads the token at L - 1 + j and the slot's hidden input, writes the head's
  residual stream back as the next step's hidden input, and returns the greedy draft for L + j.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.engine.attention import AttentionBackend, backend_factory
from tandem.engine.batch import ForwardBatch
from tandem.engine.config import ModelConfig
from tandem.engine.dummy_weights import init_dummy_weights
from tandem.engine.kernel_plan import EAGER
from tandem.engine.kv_pool import KVGroupSpec, KVPool
from tandem.engine.models.common import DecoderBody
from tandem.engine.models.context import Build, ForwardContext, Traits
from tandem.engine.quant.fp8_format import Fp8Checkpoint
from tandem.engine.quant.fp8_linear import quantize_linears
from tandem.engine.spec.eagle3 import ARCHITECTURES, Eagle3Head
from tandem.engine.spec.head import DraftHead
from tandem.engine.spec.mtp import MtpHead, mtp_config, mtp_layers
from tandem.engine.weights import load_weights, open_sources, safetensors_files

if TYPE_CHECKING:
    from tandem.engine.engine import Engine


class HiddenDrafter:
    """A head, its KV pool and backend, and the per-slot hidden inputs (see the module docstring)."""

    def __init__(self, head: DraftHead, target: Engine, slots: int) -> None:
        """`slots`: the scheduler's request slots (the token pool's rows)."""
        cfg = target.config
        self.head = head
        spec = head.layer_specs()[0]
        full = target.groups[0]
        self.groups = [KVGroupSpec(0, (spec.layer_id,), None, full.num_pages)]
        self.pool = KVPool(
            self.groups,
            cfg.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=target.kv_dtype,
            device=cfg.device,
            v_head_dim=spec.stored_v_dim,
        )
        head.attention.warm_up_store(self.pool)
        self.attention: AttentionBackend = backend_factory(cfg.attention_backend)(
            self.groups,
            cfg.page_size,
            cfg.device,
            layers=head.layer_specs(),
            dtype=cfg.dtype,
            kv_dtype=target.kv_dtype,
        )
        self.hidden = torch.zeros(slots, head.config.hidden_size, dtype=cfg.dtype, device=cfg.device)

    @torch.inference_mode()
    def follow(
        self, batch: ForwardBatch, captured: torch.Tensor, last: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """The head over a target batch whose `input_ids` are each token's next token; `captured`: the
        target's states per token; `last` [B]: each row's last accepted token in the batch; `slots` [B]."""
        hidden = self.head.project(captured)
        self.hidden.index_copy_(0, slots, hidden.index_select(0, last))
        self._run(batch, hidden)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """One draft step over `batch` (one token per row, of `slots`): int64 [R], the target's ids."""
        residual, normed = self._run(batch, self.hidden.index_select(0, slots))
        self.hidden.index_copy_(0, slots, residual)
        return self.head.propose(normed)

    def _run(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.attention.plan(batch)
        ctx = ForwardContext(self.attention, self.pool, EAGER)
        return self.head(batch.input_ids, batch.positions, hidden, ctx)  # type: ignore[no-any-return]


def load_hidden_drafter(method: str, target: Engine, slots: int, head_dir: Path | None) -> HiddenDrafter:
    """The drafter of `method` ("eagle3": the head in `head_dir`; "mtp": the target's own MTP layer),
    loaded in the target's dtype, TP group and device. Errors name the field at fault."""
    cfg, tmc = target.config, target.model_config
    body = target.model.model
    assert isinstance(body, DecoderBody)
    if method == "eagle3":
        assert head_dir is not None
        config = ModelConfig.from_dir(head_dir)
        _check_eagle3(config, tmc, head_dir)
        names = set() if cfg.load_format == "dummy" else _checkpoint_names(head_dir)
        build = Build(config, Traits(), target.tp, cfg.dtype, cfg.device, target.kernels)
        with torch.device(cfg.device):
            head: DraftHead = Eagle3Head(
                build,
                body.embed_tokens,
                tmc.num_layers,
                own_embed="embed_tokens.weight" in names,
                has_d2t="d2t" in names,
            )
        if "embed_tokens.weight" not in names and config.hidden_size != tmc.hidden_size:
            raise ValueError(
                f"speculative_config.model {str(head_dir)!r}: the head has no embed_tokens and its "
                f"hidden_size ({config.hidden_size}) is not the target's ({tmc.hidden_size})"
            )
        source = head_dir
    elif method == "mtp":
        if mtp_layers(tmc) < 1:
            raise ValueError(
                f"speculative_config.method 'mtp' needs a model with its own next-token-prediction layer "
                f"(DeepSeek-V3's num_nextn_predict_layers >= 1); {tmc.architecture} in {cfg.model_dir} "
                "has none"
            )
        build = Build(
            mtp_config(tmc),
            Traits(),
            target.tp,
            cfg.dtype,
            cfg.device,
            target.kernels,
            expert_parallel=cfg.expert_parallel,  # the layer's experts sharded as the target's are
        )
        with torch.device(cfg.device):
            head = MtpHead(build, body.embed_tokens, tmc.num_layers)
        source = cfg.model_dir
    else:
        raise ValueError(f"speculative_config.method {method!r} is not a hidden-state drafter")
    if cfg.load_format == "dummy":  # drawn like the target's: the head's checkpoint is not read
        init_dummy_weights(head)
        head.eval()
        return HiddenDrafter(head, target, slots)
    fp8 = Fp8Checkpoint.from_dir(source)
    try:
        report = load_weights(head, source, fp8=fp8)
    except ValueError as exc:  # a missing or mis-shaped tensor: say which option brought it in
        field = "method 'mtp'" if method == "mtp" else f"model {str(head_dir)!r}"
        raise ValueError(f"speculative_config.{field}: {exc}") from None
    if fp8 is not None and report.fp8_modules:
        quantize_linears(report.fp8_modules, gemm=cfg.fp8_gemm, round_trip=False, block=fp8.block)
    head.eval()
    if isinstance(head, Eagle3Head) and head.d2t is not None:
        top = int((torch.arange(head.draft_vocab, device=cfg.device) + head.d2t.offsets).max())
        if top >= tmc.vocab_size:
            raise ValueError(
                f"speculative_config.model {str(head_dir)!r}: d2t maps a draft id to {top}, outside "
                f"the target's vocabulary ({tmc.vocab_size})"
            )
    return HiddenDrafter(head, target, slots)


def _check_eagle3(config: ModelConfig, target: ModelConfig, head_dir: Path) -> None:
    problems = []
    if config.architecture not in ARCHITECTURES:
        problems.append(f"its architecture is {config.architecture!r}, not {ARCHITECTURES[0]!r}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"its vocab_size ({config.vocab_size}) is not the target's ({target.vocab_size})")
    draft_vocab = int(config.raw.get("draft_vocab_size") or config.vocab_size)
    if not 0 < draft_vocab <= config.vocab_size:
        problems.append(f"draft_vocab_size ({draft_vocab}) must lie in [1, vocab_size]")
    target_hidden = int(config.raw.get("target_hidden_size") or config.hidden_size)
    if target_hidden != target.hidden_size:
        problems.append(
            f"it reads hidden states of size {target_hidden}, the target's are {target.hidden_size}"
        )
    if problems:
        raise ValueError(f"speculative_config.model {str(head_dir)!r}: {'; '.join(problems)}")


def _checkpoint_names(head_dir: Path) -> set[str]:
    """The head checkpoint's tensor names, as the head names them (no `model.` prefix)."""
    with open_sources(safetensors_files(head_dir)) as sources:
        return {name.removeprefix("model.") for name in sources}
