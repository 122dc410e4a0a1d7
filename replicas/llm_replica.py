"""LLMReplica: one model copy over a TP group of rank actors, usable with or without Ray Serve.

It tokenizes nothing itself: callers hand it prompt token ids (the Serve deployment in `deploy/` does
the templating). It validates each request against the model's limits before anything reaches a rank and
forwards it to rank 0 over the data channel. Rank 0 sends one frame per engine step; the receive loop
handles each frame in one pass, merging every row's token into its request's `RequestStream` slot
(detokenized, stop strings applied), from which the request's consumer takes `GenerationChunk`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.cluster import placement
from tandem.cluster.rendezvous import node_ip
from tandem.engine.config import ModelConfig, check_expert_split_of
from tandem.engine.hub import resolve_model_dir
from tandem.replicas.channel import ReplicaChannel
from tandem.replicas.chunks import GenerationChunk
from tandem.replicas.constraint_check import ConstraintCheck
from tandem.replicas.detokenizer import IncrementalDetokenizer, TokenDecoder
from tandem.replicas.lora_catalog import LoraCatalog
from tandem.replicas.rank_group import RankGroup
from tandem.replicas.request_stream import RequestStream
from tandem.replicas.watchdog import (
    Problem,
    RankWatchdog,
    ReplicaUnhealthy,
    client_reason,
    codes_of,
    task_died,
)
from tandem.scheduler.messages import (
    AbortRequest,
    AddRequest,
    LoadLora,
    LoRARequest,
    TokenOutput,
    UnloadLora,
)
from tandem.scheduler.runtime import RuntimeLimits, RuntimeOptions
from tandem.scheduler.sampling_params import SamplingParams, to_spec

logger = logging.getLogger(__name__)
HEALTH_PERIOD_S = 1.0
ABORT_SEND_TIMEOUT_S = 1.0


__all__ = ["LLMReplica", "to_spec"]


class LLMReplica:
    def __init__(
        self,
        model: str | None,
        *,
        tp_size: int = 1,
        device: str = "auto",
        engine: dict[str, Any] | None = None,
        placement_strategy: str = "STRICT_PACK",
        cpus_per_rank: float = 1.0,
        max_heartbeat_age_s: float = 60.0,
        stuck_rank_timeout_s: float = 10.0,
        placement_group: Any = None,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.model = model
        self.tp_size = tp_size
        self.options = RuntimeOptions.of(device=device, **(engine or {}))
        self.placement_strategy = placement_strategy
        self.cpus_per_rank = cpus_per_rank
        self.placement_group = placement_group  # the ranks' bundles, if the caller reserved them
        self.max_heartbeat_age_s = max_heartbeat_age_s
        self._watchdog = RankWatchdog(stuck_rank_timeout_s, idle_after_s=max_heartbeat_age_s)
        self.tokenizer: Any = None
        self.model_type: str | None = None  # config.json's, once started
        self._decoder: TokenDecoder | None = None
        self.limits: RuntimeLimits | None = None
        self._group: RankGroup | None = None
        self._channel: ReplicaChannel | None = None
        self._streams: dict[int, RequestStream] = {}
        self._rids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._problems: list[Problem] = []
        self._draining = False
        self._start_lock = asyncio.Lock()
        self._constraints: ConstraintCheck | None = None
        self.catalog: LoraCatalog | None = None  # the adapters served by name, once started

    @staticmethod
    def placement_bundles(
        tp_size: int, device: str, cpus_per_rank: float = 1.0, replica_cpus: float = 1.0
    ) -> list[dict[str, float]]:
        """The Serve `placement_group_bundles` of one replica (its own CPUs merged into bundle 0)."""
        return placement.rank_bundles(
            tp_size, use_gpu=device.startswith("cuda"), cpus_per_rank=cpus_per_rank, replica_cpus=replica_cpus
        )

    @property
    def max_model_len(self) -> int:
        assert self.limits is not None, "call start() first"
        return self.limits.max_seq_len

    @property
    def max_running(self) -> int:
        """Requests the engine runs at once: what one replica should admit."""
        assert self.limits is not None, "call start() first"
        return self.limits.max_running

    @property
    def vocab_size(self) -> int:
        assert self.limits is not None, "call start() first"
        return self.limits.vocab_size

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        async with self._start_lock:
            if self.limits is not None:
                return
            await asyncio.to_thread(self._start_blocking)
            self._tasks = [
                asyncio.create_task(self._receive_loop(), name="receive_loop"),
                asyncio.create_task(self._health_loop(), name="health_loop"),
            ]
            for task in self._tasks:
                task.add_done_callback(self._task_ended)

    def _start_blocking(self) -> None:
        from transformers import AutoTokenizer

        from tandem.engine.tiny import default_model_dir

        weights = self.options.engine.load_format != "dummy"  # dummy: config and tokenizer only
        model_dir = resolve_model_dir(self.model, weights=weights) if self.model else default_model_dir()
        engine = self.options.engine
        check_expert_split_of(model_dir, self.tp_size, expert_parallel=engine.enable_expert_parallel)
        config = ModelConfig.from_dir(model_dir)
        self.model_type = config.model_type  # the server picks the chat format by it (gpt-oss: harmony)
        self.catalog = LoraCatalog(config, engine.max_lora_rank, engine.enable_lora)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._decoder = TokenDecoder(self.tokenizer)
        use_gpu = self._uses_gpu()
        self._channel = ReplicaChannel(node_ip())
        self._group = RankGroup(
            self.tp_size,
            use_gpu=use_gpu,
            cpus_per_rank=self.cpus_per_rank,
            strategy=self.placement_strategy,
            placement_group=self.placement_group,
        )
        try:
            self.limits = self._group.start(str(model_dir), self.options, self._channel.address)
        except BaseException:
            self._group.stop()
            raise

    def _uses_gpu(self) -> bool:
        if self.options.device == "auto":
            import torch

            return bool(torch.cuda.is_available())
        return self.options.device.startswith("cuda")

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Admit nothing new, let running requests finish up to the timeout, then stop the ranks."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + drain_timeout_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._fail_all("the replica is shutting down")
        for task in self._tasks:
            task.cancel()
        if self._group is not None:
            await asyncio.to_thread(self._group.stop)
        if self._channel is not None:
            self._channel.close()
        self._group = self._channel = None

    # ---- requests ----------------------------------------------------------------------------
    def admission_error(self, prompt_len: int, max_tokens: int) -> str | None:
        assert self.limits is not None, "call start() first"
        return self.limits.admission_error(prompt_len, max_tokens)

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError for anything a rank must never see."""
        assert self.limits is not None, "call start() first"
        sampling.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.limits.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        reason = self.admission_error(len(prompt_token_ids), sampling.max_tokens)
        if reason is not None:
            raise ValueError(reason)

    async def check_structured(self, sampling: SamplingParams) -> str | None:
        """Why the request's output constraint cannot be used, or None (see ConstraintCheck)."""
        if sampling.structured_outputs is None:
            return None
        await self.start()
        if self._constraints is None:
            self._constraints = ConstraintCheck(self.tokenizer)
        return await self._constraints.problem(sampling)

    # ---- LoRA adapters -------------------------------------------------------------------------
    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` (a local PEFT directory) as `name`: checked against the model
        (ValueError naming what is wrong), then read into the ranks' host caches."""
        await self.start()
        assert self.catalog is not None and self._channel is not None
        lora, new = await asyncio.to_thread(self.catalog.add, name, path)
        if new:
            await self._channel.send(LoadLora(lora))
        return lora

    async def remove_lora(self, name: str) -> bool:
        """Stop serving `name` (False if it is not served); requests running with it finish."""
        await self.start()
        assert self.catalog is not None and self._channel is not None
        lora = self.catalog.remove(name)
        if lora is not None:
            await self._channel.send(UnloadLora(lora.id))
        return lora is not None

    async def check_lora(self, path: str) -> None:
        """Raise ValueError naming what keeps the adapter at `path` from being served here."""
        await self.start()
        assert self.catalog is not None
        await asyncio.to_thread(self.catalog.check, path)

    @property
    def lora_enabled(self) -> bool:
        return self.options.engine.enable_lora

    def lora(self, name: str) -> LoRARequest | None:
        return None if self.catalog is None else self.catalog.get(name)

    def loras(self) -> list[LoRARequest]:
        return [] if self.catalog is None else self.catalog.all()

    async def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        listener: Callable[[], None] | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate the request and send it to the ranks; its output arrives in the returned stream.
        `lora`: an adapter from `add_lora` (None: the base model).

        The caller must `release` the stream when done with it (finished or not)."""
        await self.start()
        self.validate(prompt_token_ids, sampling)
        if lora is not None and not self.options.engine.enable_lora:
            raise ValueError("LoRA adapters need enable_lora=True")
        # An adapter unloaded meanwhile (Serve's multiplexing let it go) still runs: the request carries
        # its path, from which the ranks read it again.
        problem = await self.check_structured(sampling)
        if problem is not None:
            raise ValueError(f"structured_outputs cannot be used: {problem}")
        if self._draining:
            raise RuntimeError("the replica is shutting down and admits no new requests")
        if self._problems:
            raise RuntimeError(f"the replica is unhealthy ({codes_of(self._problems)}); see the server log")
        assert self._channel is not None and self._decoder is not None
        rid = next(self._rids)
        detok = IncrementalDetokenizer(self._decoder, prompt_token_ids, sampling.stop_strings)
        stream = RequestStream(
            request_id or f"req-{rid}", rid, len(prompt_token_ids), sampling, detok, listener
        )
        self._streams[rid] = stream
        try:
            await self._channel.send(AddRequest(rid, prompt_token_ids, to_spec(sampling), lora))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    async def release(self, stream: RequestStream) -> None:
        """Forget a stream; if the ranks still run its request (a client gone), abort it there."""
        if self._streams.pop(stream.rid, None) is None:
            return
        if not stream.scheduler_done and self._channel is not None:
            stream.scheduler_done = True
            # Bounded: with rank 0 gone a zmq send waits for a peer; the health loop handles that case.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._channel.send(AbortRequest(stream.rid)), ABORT_SEND_TIMEOUT_S)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """`submit`, then each chunk as it is taken; closing the generator early aborts the request."""
        stream = await self.submit(prompt_token_ids, sampling, request_id, lora=lora)
        try:
            while True:
                chunk = await stream.next_chunk()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            await self.release(stream)

    async def abort(self, request_id: str) -> None:
        for rid, stream in list(self._streams.items()):
            if stream.request_id == request_id and self._channel is not None:
                await self._channel.send(AbortRequest(rid))

    # ---- background tasks --------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        """One pass per engine step: merge every row into its stream; abort what a stop string ended."""
        assert self._channel is not None
        channel = self._channel
        while True:
            outputs: list[TokenOutput] = await channel.recv()
            ended: list[int] = []
            for out in outputs:
                stream = self._streams.get(out.rid)
                if stream is None:
                    continue
                stream.merge(out)
                if stream.finished and not stream.scheduler_done:
                    stream.scheduler_done = True  # a stop string ended it in the replica
                    ended.append(out.rid)
            for rid in ended:
                await channel.send(AbortRequest(rid))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            if self._group is None:
                return
            problems = await asyncio.to_thread(self._group.problems, self._watchdog)
            if problems:
                self._unhealthy(problems)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        # A background task ending on its own (not cancelled at shutdown) leaves requests unserved.
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("it returned")
        if self._group is not None:
            self._unhealthy([task_died(task.get_name(), exc)])

    def _unhealthy(self, problems: list[Problem]) -> None:
        failing = [s for s in self._streams.values() if not s.finished]
        if failing or not self._problems:  # the health loop finds the same problems every period
            ids = ", ".join(s.request_id for s in failing) or "none"
            logger.error("replica unhealthy: %s; requests ended: %s", ReplicaUnhealthy(problems), ids)
        self._problems = problems
        for stream in failing:
            stream.fail(client_reason(problems, stream.request_id))

    def _fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.fail(reason)

    async def check_health(self) -> None:
        if self._problems:
            raise ReplicaUnhealthy(self._problems)
        if self._group is None:
            raise ReplicaUnhealthy([Problem("not_running", "the replica is not running")])
        problems = await asyncio.to_thread(self._group.problems, self._watchdog)
        if problems:
            self._unhealthy(problems)
            raise ReplicaUnhealthy(problems)

    async def stats(self) -> dict[str, Any]:
        """Rank 0's scheduler stats (every rank takes the same decisions, so they agree)."""
        if self._group is None or not self._group.actors:
            return {}
        return dict(await self._group.actors[0].stats.remote())

    async def rank_stats(self) -> list[dict[str, Any]]:
        assert self._group is not None
        return [dict(await a.stats.remote()) for a in self._group.actors]

    async def describe_ranks(self) -> list[dict[str, Any]]:
        assert self._group is not None
        return [dict(await a.describe.remote()) for a in self._group.actors]

    async def sampled_tokens(self) -> list[list[tuple[int, int]]]:
        """Debug hook: each rank's sampled (request id, token) pairs, to check that ranks agree."""
        assert self._group is not None
        return [await a.sampled_tokens.remote() for a in self._group.actors]
