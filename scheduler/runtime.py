"""One rank's engine and scheduler, built from the user's options, and the loops that drive them.

`tandem.LLM` runs a RankRuntime in-process for tp_size=1; each Ray rank actor runs one per GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.hub import resolve_model_dir
from tandem.engine.pool_share import PoolShare
from tandem.engine.spec.hidden_drafter import load_hidden_drafter
from tandem.engine.streams import StreamSet
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.inflight import InFlight
from tandem.scheduler.kv_manager import GroupInfo, KVManager, admission_error
from tandem.scheduler.lora_slots import AdapterSlots
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.options import RuntimeOptions
from tandem.scheduler.scheduler import MessageSource, Scheduler
from tandem.scheduler.spec.decoding import SpecDecoding
from tandem.scheduler.spec.hidden_drafts import HiddenDrafts
from tandem.scheduler.structured.grammar import GrammarCache, hf_tokenizer_info

__all__ = ["RankRuntime", "RuntimeLimits", "RuntimeOptions"]


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeLimits:
    """What a front end needs to validate requests before they reach a rank."""

    groups: list[GroupInfo]
    page_size: int
    chunk_size: int
    max_seq_len: int
    vocab_size: int
    max_running: int  # requests the scheduler runs at once; more wait in its queue
    max_loras: int = 0  # LoRA adapters one batch may use (GPU slots); 0: LoRA off
    max_lora_rank: int = 0
    keep_window: int | None = None  # the prompt-end window requests keep for the prefix cache

    def admission_error(self, prompt_len: int, max_tokens: int) -> str | None:
        return admission_error(
            self.groups,
            self.page_size,
            self.chunk_size,
            self.max_seq_len,
            prompt_len,
            max_tokens,
            self.keep_window,
        )


# The request table's rows when nothing smaller bounds them: decode batches beyond the largest CUDA graph
# run eagerly, and on CPU a larger batch only lengthens every step.
MAX_RUNNING_GPU = 256
MAX_RUNNING_CPU = 64


def default_max_running(on_gpu: bool, options: RuntimeOptions, kv: KVManager) -> int:
    """What the engine can run at once: the decode graphs' largest batch on GPU, and never more requests
    than the KV pool has pages for (each running request holds at least one page of every group)."""
    limit = MAX_RUNNING_CPU
    if on_gpu:
        engine = options.engine
        limit = min(MAX_RUNNING_GPU, engine.cuda_graph_max_bs) if engine.cuda_graph else MAX_RUNNING_GPU
    return max(1, min([limit, *(g.num_pages for g in kv.groups)]))


class RankRuntime:
    """Engine + scheduler of one rank, with the streams they share."""

    def __init__(
        self,
        model_dir: Path,
        options: RuntimeOptions,
        tp: TPGroup,
        emit: Callable[[list[TokenOutput]], None],
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        config = resolve_engine_config(model_dir, options.engine)
        spec = options.speculative_config
        if config.num_pages is None and spec is not None and spec.method == "draft_model":
            # The target sizes its pool from free memory before the draft loads: it leaves the draft's
            # weights and its pool (the target's page count) out of the budget first.
            assert spec.model is not None
            dummy = options.engine.load_format == "dummy"
            share = PoolShare.of_model(
                resolve_model_dir(spec.model, weights=not dummy), tp.size, config.dtype, dummy
            )
            config = dataclasses.replace(config, pool_share=share)
        self.streams = StreamSet(config.device)
        self.engine = Engine(config, tp, self.streams, progress)
        mc = self.engine.model_config
        self.max_seq_len = min(
            mc.max_position_embeddings, options.max_model_len or mc.max_position_embeddings
        )
        on_gpu = config.device.type == "cuda"
        chunk = options.chunk_size or 8192
        kv = KVManager(
            [GroupInfo(g.group_id, g.window, g.num_pages) for g in self.engine.groups],
            config.page_size,
            prefix_cache=options.prefix_cache,
            chunk_size=chunk,
        )
        sched_config = SchedulerConfig(
            max_running=options.max_running or default_max_running(on_gpu, options, kv),
            chunk_size=chunk,
            max_seq_len=self.max_seq_len,
            prefix_cache=kv.caching,
            overlap=options.overlap,
            seed=options.seed,
            guard_inflight_pages=options.guard_inflight_pages,
        )
        grammars = GrammarCache(lambda: _tokenizer_info(model_dir, mc.eos_token_ids))
        lora = None
        if self.engine.lora is not None and config.lora is not None:
            cached = options.max_cpu_loras or 2 * config.lora.max_loras
            lora = AdapterSlots(self.engine.lora, config.lora.max_loras, cached)
        drafting = None
        if spec is not None:
            drafting = self._speculation(options, tp, sched_config.max_seq_len, sched_config.max_running)
        self.scheduler = Scheduler(
            sched_config,
            self.engine,
            kv,
            self.streams,
            mc.eos_token_ids,
            emit,
            grammars=grammars,
            lora=lora,
            spec=drafting,
        )
        self.overlap = options.overlap
        self._last: InFlight | None = None

    def _speculation(
        self, options: RuntimeOptions, tp: TPGroup, max_seq_len: int, slots: int
    ) -> SpecDecoding:
        """The rank's speculative decoding; for `draft_model`, its draft engine: same device, dtype and TP
        group, and a KV pool of the target's page count and size, so one page table serves both; for
        `eagle3` and `mtp`, a head over the target's hidden states, its KV pool likewise."""
        spec = options.speculative_config
        assert spec is not None
        vocab = self.engine.model_config.vocab_size
        if spec.method in ("eagle3", "mtp"):
            if len(self.engine.groups) != 1 or self.engine.groups[0].window is not None:
                raise ValueError(f"speculative_config.method {spec.method!r} needs a full-attention target")
            weights = options.engine.load_format != "dummy"  # dummy: the head's config.json only
            head_dir = None if spec.model is None else resolve_model_dir(spec.model, weights=weights)
            drafter = load_hidden_drafter(spec.method, self.engine, slots, head_dir)
            self.engine.capture = drafter.head.capture
            if self.engine.decode_graphs is not None or self.engine.piecewise is not None:
                # Said at start-up: the speed a user expects from CUDA graphs is not there with these.
                logger.warning(
                    "speculative_config.method %r: the target runs without CUDA graphs in this build "
                    "(the graphs keep none of the hidden states the draft head reads)",
                    spec.method,
                )
            drafts = HiddenDrafts(drafter, max_seq_len)
            return SpecDecoding(spec, max_seq_len, vocab_size=vocab, hidden=drafts)
        if spec.method != "draft_model":
            return SpecDecoding(spec, max_seq_len, vocab_size=vocab)
        assert spec.model is not None
        draft_dir = resolve_model_dir(spec.model, weights=options.engine.load_format != "dummy")
        target = self.engine
        full = target.groups[0]
        draft_options = dataclasses.replace(
            options.engine,
            num_pages=full.num_pages,
            page_size=target.config.page_size,
            cuda_graph=False,
            piecewise_cuda_graph=False,
            enable_lora=False,
            quantization=None,
        )
        draft = Engine(resolve_engine_config(draft_dir, draft_options), tp, self.streams)
        problems = []
        if len(draft.groups) != 1 or draft.groups[0].window is not None or len(target.groups) != 1:
            problems.append("draft and target must both be full-attention models")
        if draft.model_config.vocab_size > vocab:
            problems.append(
                f"its vocabulary ({draft.model_config.vocab_size}) exceeds the target's ({vocab})"
            )
        # The draft runs at every position the target does; past its own length its rotary table (the
        # fused CUDA kernels') has no row to read.
        if draft.model_config.max_position_embeddings < max_seq_len:
            problems.append(
                f"its max_position_embeddings ({draft.model_config.max_position_embeddings}) is below "
                f"the target's context length ({max_seq_len}); set max_model_len to at most the draft's"
            )
        if problems:
            raise ValueError(f"speculative_config.model {spec.model!r}: {'; '.join(problems)}")
        return SpecDecoding(spec, max_seq_len, draft=draft, vocab_size=draft.model_config.vocab_size)

    def step(self, receive: MessageSource) -> None:
        """One loop iteration; the caller keeps calling while `busy`."""
        with self.streams.use(self.streams.scheduler), torch.inference_mode():
            if self.overlap:
                self._last = self.scheduler.overlap_step(receive, self._last)
            else:
                self.scheduler.normal_step(receive)

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or self._last is not None

    def limits(self) -> RuntimeLimits:
        kv = self.scheduler.kv
        return RuntimeLimits(
            groups=list(kv.groups),
            page_size=kv.page_size,
            chunk_size=kv.chunk_size,
            max_seq_len=self.max_seq_len,
            vocab_size=self.engine.model_config.vocab_size,
            max_running=self.scheduler.config.max_running,
            max_loras=lora.max_loras if (lora := self.engine.config.lora) is not None else 0,
            max_lora_rank=lora.max_lora_rank if lora is not None else 0,
            keep_window=kv.keep_window,
        )


def _tokenizer_info(model_dir: Path, eos_token_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of the model's vocabulary, for the rank's structured-output matchers."""
    from transformers import AutoTokenizer

    return hf_tokenizer_info(AutoTokenizer.from_pretrained(model_dir), eos_token_ids)
