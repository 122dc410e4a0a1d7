"""The engine: forward one tensor batch, sample, and start the copy of the results to the host."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from tandem.engine.attention import AttentionBackend, backend_factory
from tandem.engine.batch import (
    ForwardBatch,
    ForwardOutput,
    PromptLogprobBatch,
    PromptLogprobs,
    SamplingBatch,
    SpecBatch,
    StepLogits,
)
from tandem.engine.config import ModelConfig
from tandem.engine.cuda_graph import DecodeGraphRunner
from tandem.engine.distributed import TPGroup
from tandem.engine.dummy_weights import init_dummy_weights
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kernel_plan import EAGER, EAGER_LORA, KernelPlanner
from tandem.engine.kv_pool import KVGroupSpec, KVPool, plan_groups
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.lora.runtime import EngineLora
from tandem.engine.models import model_class
from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import ForwardContext
from tandem.engine.piecewise_graph import PiecewiseGraphRunner
from tandem.engine.pool_share import kv_pages
from tandem.engine.quant.fp8_format import Fp8Checkpoint, layer_kv_scales
from tandem.engine.quant.fp8_linear import quantize_linears
from tandem.engine.quant.mxfp4 import Mxfp4Checkpoint
from tandem.engine.sampler import Sampler, SampleResult
from tandem.engine.spec.head import HiddenCapture
from tandem.engine.spec.verify import verify
from tandem.engine.streams import Event, StreamSet
from tandem.engine.weights import LoadReport, load_weights

logger = logging.getLogger(__name__)
# Prompt positions whose logits are taken at once: bounds the [K, vocab] float32 copy (a 150k vocabulary
# makes it 600 MB per 1024 positions) however long the prompt.
PROMPT_LOGPROB_CHUNK = 512


class Engine:
    """Owns the model, the KV pool, the attention backend, the CUDA graphs and the sampler of one rank.

    It never sees requests: the scheduler hands it a `ForwardBatch` and gets a `ForwardOutput`.
    A batch runs through a decode graph when one fits, else through piecewise graphs when its token
    count fits a bucket, else eagerly; all three run the same modules (padding aside, the same math).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TPGroup,
        streams: StreamSet,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.streams = streams
        self.model_config = ModelConfig.from_dir(config.model_dir)
        mc = self.model_config
        kernels = (
            FusedKernels(
                mc.max_position_embeddings,
                triton=config.triton,
                tinygemm=config.small_gemm_max_bs > 0,
            )
            if config.fused_kernels
            else None
        )
        # Which kernels each captured shape runs: one plan per decode graph and piecewise bucket.
        self.planner = KernelPlanner.from_config(config)
        mxfp4 = Mxfp4Checkpoint.from_dir(config.model_dir)
        # MXFP4 experts stay 4-bit where the Triton MoE kernels read them; elsewhere (CPU) they are
        # dequantized at load, so the torch path computes on exactly HF's values.
        triton = kernels is not None and kernels.triton is not None
        self.mxfp4_experts = mxfp4 is not None and mxfp4.resident(config.device, triton=triton)
        fp8 = Fp8Checkpoint.from_dir(config.model_dir)
        # Block-scaled FP8 experts stay FP8 the same way (their scale block, or None: dequantized).
        self.fp8_experts = None if fp8 is None else fp8.expert_block(config.device, triton=triton)
        with torch.device(config.device):
            self.model: CausalLM = model_class(mc.architecture)(
                mc,
                tp,
                config.dtype,
                config.device,
                kernels,
                expert_parallel=config.expert_parallel,
                mxfp4_experts=self.mxfp4_experts,
                fp8_experts=self.fp8_experts,
            )
        self.kernels = kernels
        self.fp8_layers = 0  # linear layers whose GEMMs run in FP8 (CUDA)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
            # Nothing was read: drawn weights take the checkpoint's format on every linear layer (its
            # blocks where it has them), so a dummy FP8 model runs the kernels the real one would.
            report = LoadReport(fp8_modules=self.model.linear_layers() if fp8 is not None else [])
        else:
            report = load_weights(self.model, config.model_dir, progress, fp8, mxfp4)
        self.kv_dtype = config.kv_cache_dtype or config.dtype
        if fp8 is not None or config.quantization == "fp8":
            # An FP8 checkpoint's own FP8 layers (not its `ignore` list); dynamic FP8: every linear layer.
            linears = report.fp8_modules if fp8 is not None else self.model.linear_layers()
            self.fp8_layers = quantize_linears(
                linears, gemm=config.fp8_gemm, round_trip=fp8 is None, block=fp8.block if fp8 else None
            )
            # Hand the 16-bit weights' memory back, so the KV pool is sized with it.
            if config.fp8_gemm is not None:
                torch.cuda.empty_cache()
        # The weights' bytes on this rank as they sit in memory (resident MXFP4 experts: their packed
        # bytes and scales); the KV pool is sized from what the device has free after them.
        self.weight_bytes = sum(p.nbytes for p in self.model.parameters())
        logger.info("weights: %.2f GiB on this rank", self.weight_bytes / 2**30)
        self.model.eval()
        self.capture_seconds = 0.0
        # Set when a hidden-state drafter reads this model's hidden states (engine/spec/head.py): every
        # forward then runs eagerly and returns them with its logits.
        self.capture: HiddenCapture | None = None
        # LoRA slots come before the graphs, which read them, and before the KV pool is sized.
        self.lora: EngineLora | None = None
        if config.lora is not None:
            graph_tokens = max(
                config.cuda_graph_max_bs if config.cuda_graph else 0,
                config.piecewise_max_tokens if config.piecewise_cuda_graph else 0,
            )
            self.lora = EngineLora(
                self.model,
                mc,
                config.lora,
                dtype=config.dtype,
                device=config.device,
                graph_tokens=graph_tokens,
            )
        # Piecewise graphs need no KV pool, so they are captured first and the pool is sized from
        # what is free after weights and graphs.
        self.piecewise: PiecewiseGraphRunner | None = None
        if config.piecewise_cuda_graph:
            self.piecewise = PiecewiseGraphRunner(
                self.model,
                max_tokens=config.piecewise_max_tokens,
                device=config.device,
                planner=self.planner,
                lora=self.lora,
            )
            self._timed(self.piecewise.capture)
        self.groups: list[KVGroupSpec] = plan_groups(mc, self._num_pages())
        k_dim, v_dim = self.model.kv_head_dims
        self.pool = KVPool(
            self.groups,
            config.page_size,
            self.model.local_kv_heads,
            k_dim,
            dtype=self.kv_dtype,
            device=config.device,
            scales=layer_kv_scales(report.kv_scales),
            v_head_dim=v_dim,
        )
        # What one token costs in the KV cache of this rank (latent attention: one latent per layer).
        self.kv_bytes_per_token = self.pool.bytes_per_token()
        self.model.warm_up_kv_store(self.pool)  # on CUDA: no Triton build waits for the first long prefill
        self.attention: AttentionBackend = backend_factory(config.attention_backend)(
            self.groups,
            config.page_size,
            config.device,
            layers=self.model.layer_specs(),
            dtype=config.dtype,
            kv_dtype=self.kv_dtype,
        )
        self.sampler = Sampler(
            mc.vocab_size,
            device=config.device,
            fused_draw=kernels.sample if kernels is not None else None,
            race=kernels.race_sample if kernels is not None else None,
        )
        problem = self.sampler.warm_up(self.model.logits_dtype)
        if problem is not None:
            logger.warning("%s", problem)
        # Decode graphs bake in the pool's and the backend's buffer addresses, so they come last.
        self.decode_graphs: DecodeGraphRunner | None = None
        if config.cuda_graph:
            self.decode_graphs = DecodeGraphRunner(
                self.model,
                self.attention,
                self.pool,
                max_bs=config.cuda_graph_max_bs,
                max_pages_per_row=-(-mc.max_position_embeddings // config.page_size),
                device=config.device,
                planner=self.planner,
                lora=self.lora,
            )
            self._timed(self.decode_graphs.capture)

    def _timed(self, capture: Callable[[], None]) -> None:
        start = time.perf_counter()
        capture()
        self.capture_seconds += time.perf_counter() - start

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        cfg = self.config
        free, total = torch.cuda.mem_get_info(cfg.device)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()  # FP8: twice the pages
        token_bytes = self.model.kv_bytes_per_token(elem)
        return kv_pages(free, total, cfg.mem_fraction, cfg.page_size, token_bytes, elem, cfg.pool_share)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        step = self.step_logits(batch)
        return self.sample(step.logits, batch.sampling, step.prompt, batch.spec, step.captured)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        sampling: SamplingBatch,
        prompt: PromptLogprobs | None = None,
        spec: SpecBatch | None = None,
        captured: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Sample from `logits` (from `step_logits`) and start the copy of the tokens (and of `prompt`'s
        log-probs) to the host. Apart from the forward, so the scheduler can launch a batch's forward
        before its token bitmasks are known. With `spec`, the drafts are verified on the device
        (spec/verify.py) and the accept counts travel with the tokens. `captured` (the forward's hidden
        states for a drafter) rides along on the device."""
        result = self.sampler(logits, sampling)
        if spec is None:
            output = self._copy_to_host(result, prompt)
        else:
            checked = verify(result, spec)
            grid = SampleResult(checked.tokens, checked.logprobs, checked.top_ids, checked.top_logprobs)
            output = self._copy_to_host(grid, prompt, checked.accepted)
        return output if captured is None else replace(output, captured=captured)

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """[B, vocab] for each row's last token, in `model.logits_dtype` (the forward without sampling)."""
        return self.step_logits(batch).logits

    @torch.inference_mode()
    def step_logits(self, batch: ForwardBatch) -> StepLogits:
        """The forward without sampling: each row's last-token logits, and the log-probs of the prompt
        positions `batch.prompt_logprobs` lists. Such a batch runs eagerly or in piecewise graphs, which
        keep every token's hidden state; a decode graph keeps only the last."""
        lora = self.lora
        adapters = lora is not None and batch.lora_slots_cpu is not None
        # A drafter's hidden states are taken in the eager forward only (the graphs keep none of them).
        graphs = self.decode_graphs if self.capture is None else None
        piecewise = self.piecewise if self.capture is None else None
        graph_bs = graphs.padded_size(batch) if graphs is not None else None
        if graphs is not None and graph_bs is not None and batch.prompt_logprobs is None:
            if lora is not None and adapters:
                lora.plan(batch, graph=True)
            return StepLogits(graphs.run(batch, graph_bs, lora=adapters))
        self.attention.plan(batch)
        bucket = piecewise.padded_size(batch) if piecewise is not None else None
        captured = None
        if piecewise is not None and bucket is not None:
            if lora is not None:  # the pieces are captured with the deltas: a base batch plans no tiles
                lora.plan(batch, graph=True)
            hidden = piecewise.run(batch, ForwardContext(self.attention, self.pool, EAGER), bucket)
        else:
            if lora is not None and adapters:
                lora.plan(batch, graph=False)
            ctx = ForwardContext(self.attention, self.pool, EAGER_LORA if adapters else EAGER)
            if self.capture is None:
                hidden = self.model(batch.input_ids, batch.positions, ctx)
            else:
                hidden, captured = self.model.forward_capturing(
                    batch.input_ids, batch.positions, ctx, self.capture.layers
                )
        prompt = None
        if batch.prompt_logprobs is not None:
            prompt = self._prompt_logprobs(hidden, batch.prompt_logprobs)
        if batch.spec is not None:  # every scored position of a row with drafts
            hidden = hidden[batch.spec.logit_index]
        elif not batch.is_decode:  # decode rows are their own last token
            hidden = hidden[torch.cumsum(batch.extend_lens, 0, dtype=torch.int64) - 1]
        return StepLogits(self.model.compute_logits(hidden), prompt, captured)

    def _prompt_logprobs(self, hidden: torch.Tensor, asked: PromptLogprobBatch) -> PromptLogprobs:
        """Log-softmax of the raw logits at the asked positions only, a chunk of them at a time."""
        vocab = self.sampler.vocab_size
        chosen, top_ids, top_values = [], [], []
        for start in range(0, int(asked.token_index.shape[0]), PROMPT_LOGPROB_CHUNK):
            index = asked.token_index[start : start + PROMPT_LOGPROB_CHUNK]
            logprobs = self.model.compute_logits(hidden[index])[:, :vocab].float().log_softmax(dim=-1)
            targets = asked.target_ids[start : start + PROMPT_LOGPROB_CHUNK]
            chosen.append(logprobs.gather(1, targets[:, None]).squeeze(1))
            if asked.num_top > 0:
                top = logprobs.topk(min(asked.num_top, vocab), dim=-1, sorted=True)
                top_ids.append(top.indices)
                top_values.append(top.values)
        return PromptLogprobs(
            torch.cat(chosen),
            torch.cat(top_ids) if top_ids else None,
            torch.cat(top_values) if top_values else None,
        )

    def _copy_to_host(
        self,
        result: SampleResult,
        prompt: PromptLogprobs | None = None,
        accepted: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Start the D2H copy on the copy stream; the caller waits on `copy_done` one step later."""
        done = self.streams.new_event()
        tensors = [result.next_tokens, result.logprobs, result.top_ids, result.top_logprobs, accepted]
        if prompt is not None:
            tensors += [prompt.logprobs, prompt.top_ids, prompt.top_logprobs]
        if not self.streams.is_cuda:
            hosts = [t.clone() if t is not None else None for t in tensors]
            done.record()
            return _output(result.next_tokens, hosts, done, accepted)
        producer = self.streams.current()
        copy = self.streams.copy if self.config.copy_stream else producer
        assert isinstance(copy, torch.cuda.Stream) and isinstance(producer, torch.cuda.Stream)
        self.streams.wait(copy, on=producer)
        with self.streams.use(copy):
            hosts = []
            for t in tensors:
                if t is None:
                    hosts.append(None)
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                # The caching allocator must not hand this memory out again until the copy is done.
                t.record_stream(copy)
                hosts.append(host)
            done.record(copy)
        return _output(result.next_tokens, hosts, done, accepted)


def _output(
    next_tokens: torch.Tensor,
    hosts: list[torch.Tensor | None],
    done: Event,
    accepted: torch.Tensor | None,
) -> ForwardOutput:
    """The ForwardOutput of `_copy_to_host`'s host copies, in the order it lists them."""
    assert hosts[0] is not None
    prompt = None
    if len(hosts) > 5:
        assert hosts[5] is not None
        prompt = PromptLogprobs(hosts[5], hosts[6], hosts[7])
    return ForwardOutput(
        next_tokens, hosts[0], hosts[1], hosts[2], hosts[3], done, prompt, accepted, hosts[4]
    )
