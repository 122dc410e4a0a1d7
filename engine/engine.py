"""The engine: forward one tensor batch, sample, and start the copy of the results to the host."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.attention import AttentionBackend, backend_factory
from tandem.engine.batch import ForwardBatch, ForwardOutput
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv_pool import KVGroupSpec, KVPool, plan_groups
from tandem.engine.models import model_class
from tandem.engine.models.common import CausalLM, ForwardContext
from tandem.engine.sampler import Sampler, SampleResult
from tandem.engine.streams import StreamSet
from tandem.engine.weights import load_weights


class Engine:
    """Owns the model, the KV pool, the attention backend and the sampler of one rank.

    It never sees requests: the scheduler hands it a `ForwardBatch` and gets a `ForwardOutput`.
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
        with torch.device(config.device):
            self.model: CausalLM = model_class(mc.architecture)(mc, tp, config.dtype, config.device)
        load_weights(self.model, config.model_dir, progress)
        self.model.eval()
        self.groups: list[KVGroupSpec] = plan_groups(mc, self._num_pages())
        local_kv = self.model.local_kv_heads
        self.pool = KVPool(
            self.groups, config.page_size, local_kv, mc.head_dim, dtype=config.dtype, device=config.device
        )
        self.attention: AttentionBackend = backend_factory(config.attention_backend)(
            self.groups, config.page_size, config.device
        )
        self.sampler = Sampler(mc.vocab_size)

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        mc, cfg = self.model_config, self.config
        free, total = torch.cuda.mem_get_info(cfg.device)
        budget = free - (1.0 - cfg.mem_fraction) * total
        local_kv = max(1, mc.num_kv_heads // self.tp.size)
        elem = torch.empty((), dtype=cfg.dtype).element_size()
        page_bytes = 2 * mc.num_layers * local_kv * mc.head_dim * elem * cfg.page_size
        if budget < page_bytes * 64:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache after loading weights: {budget / 2**30:.2f} GiB "
                f"left at mem_fraction={cfg.mem_fraction}"
            )
        return int(budget // page_bytes)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.attention.plan(batch)
        ctx = ForwardContext(self.attention, self.pool)
        hidden = self.model(batch.input_ids, batch.positions, ctx)
        last = torch.cumsum(batch.extend_lens, 0, dtype=torch.int64) - 1
        logits = self.model.compute_logits(hidden[last])
        return self._copy_to_host(self.sampler(logits, batch.sampling))

    def _copy_to_host(self, result: SampleResult) -> ForwardOutput:
        """Start the D2H copy on the copy stream; the caller waits on `copy_done` one step later."""
        done = self.streams.new_event()
        tensors = [result.next_tokens, result.logprobs, result.top_ids, result.top_logprobs]
        if not self.streams.is_cuda:
            hosts = [t.clone() if t is not None else None for t in tensors]
            done.record()
            return ForwardOutput(result.next_tokens, hosts[0], hosts[1], hosts[2], hosts[3], done)  # type: ignore[arg-type]
        producer = torch.cuda.current_stream(self.config.device)
        copy = self.streams.copy if self.config.copy_stream else producer
        assert isinstance(copy, torch.cuda.Stream)
        copy.wait_stream(producer)
        with torch.profiler.record_function("tandem.d2h_copy"), torch.cuda.stream(copy):
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
        assert hosts[0] is not None
        return ForwardOutput(result.next_tokens, hosts[0], hosts[1], hosts[2], hosts[3], done)
