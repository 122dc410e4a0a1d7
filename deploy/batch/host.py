"""One tandem engine inside a Ray Data actor: an `LLMReplica` with its rank actors (in the actor's own
placement group, `actor_group.py`), and the request path over it, on an event loop thread of its own.

Ray Data builds the actor's callable in a plain constructor and calls it on an event loop of its own, so
the replica (whose background tasks belong to the loop that started it) lives on a private loop: it
starts, loads the model and fails in the constructor, where Ray Data counts a failure as the actor's, and
each batch hops to it and back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from tandem.cluster import placement
from tandem.deploy.batch.actor_group import reserve_actor_group
from tandem.deploy.generation.service import GenerationService
from tandem.deploy.observability.metrics import NullMetrics
from tandem.deploy.protocol.harmony.chat import HarmonyChat
from tandem.replicas.llm_replica import LLMReplica
from tandem.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
SHUTDOWN_TIMEOUT_S = 10.0
WARM_UP_REQUESTS, WARM_UP_PROMPT_TOKENS, WARM_UP_TOKENS = 8, 64, 16


@dataclass(frozen=True)
class EngineSpec:
    """What one actor's engine is, resolved in the driver (the device, the template's text)."""

    model: str
    tp_size: int = 1
    device: str = "cpu"
    engine: dict[str, Any] = field(default_factory=dict)
    placement_strategy: str = "STRICT_PACK"
    cpus_per_rank: float = 1.0
    accelerator_type: str | None = None
    chat_template: str | None = None

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per rank; an accelerator type adds a sliver of Ray's resource of that name."""
        use_gpu = self.device.startswith("cuda")
        bundles = placement.rank_bundles(self.tp_size, use_gpu=use_gpu, cpus_per_rank=self.cpus_per_rank)
        if use_gpu and self.accelerator_type is not None:
            for bundle in bundles:
                bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundles


class EngineFailure(RuntimeError):
    """The engine can no longer run requests (a rank died, the replica refuses work)."""


class EngineHost:
    def __init__(self, spec: EngineSpec) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tandem-batch-engine", daemon=True
        )
        self._thread.start()
        self.group: Any = None
        self.replica: LLMReplica
        try:
            self.group = reserve_actor_group(spec.bundles(), spec.placement_strategy)
            self.replica = LLMReplica(
                spec.model,
                tp_size=spec.tp_size,
                device=spec.device,
                engine=spec.engine,
                placement_strategy=spec.placement_strategy,
                cpus_per_rank=spec.cpus_per_rank,
                placement_group=self.group,
            )
            self.call(self.replica.start())
            self.call(self._warm_up())
        except BaseException:
            self.close()
            raise
        self.harmony, self.generation = chat_service(self.replica, spec.chat_template)

    async def _warm_up(self) -> None:
        """A few short requests before the actor takes rows, so that first-use work (kernel setup,
        allocator growth) is done at start, as LLM's callers do it, rather than in the first batch."""
        vocab, room = self.replica.vocab_size, self.replica.max_model_len
        tokens = max(1, min(WARM_UP_TOKENS, room // 4))
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        length = max(1, min(WARM_UP_PROMPT_TOKENS, room - tokens))
        if self.replica.admission_error(length, tokens) is not None:
            return  # an engine too small for even this: its first batch pays instead

        async def one(offset: int) -> None:
            prompt = [(offset + 7 * i) % vocab for i in range(length)]
            async for _ in self.replica.generate(prompt, sampling):
                pass

        await asyncio.gather(*(one(k) for k in range(WARM_UP_REQUESTS)))

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and wait for it (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and await it from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        replica: LLMReplica | None = getattr(self, "replica", None)
        if replica is not None and replica.limits is not None:
            future = asyncio.run_coroutine_threadsafe(replica.shutdown(drain_timeout_s=0.0), self._loop)
            try:
                future.result(SHUTDOWN_TIMEOUT_S)
            except Exception:  # leaving anyway; the rank actors die with this actor
                logger.warning("the engine did not shut down cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._loop.close()
        placement.release(self.group)


def chat_service(replica: Any, chat_template: str | None) -> tuple[HarmonyChat | None, GenerationService]:
    """The request path over a started replica, and the harmony format when its model is gpt-oss: its
    chats are then rendered and read as harmony, as the server's are."""
    harmony = HarmonyChat.for_model(replica.model_type, replica.tokenizer)
    if harmony is not None:
        chat_template = harmony.chat_template(chat_template, replica.tokenizer)
    generation = GenerationService(
        replica, NullMetrics(), vocab_size=replica.vocab_size, chat_template=chat_template
    )
    return harmony, generation


def exit_for_restart(reason: BaseException) -> NoReturn:
    """End this actor's process so that Ray restarts it with a fresh engine and retries its batches.

    An exception would fail the batch for good: Ray retries actor tasks only when the actor dies, and a
    process exit is such a death (ray.actor.exit_actor is an intended exit, which is not retried)."""
    logger.error("tandem batch: the engine failed (%s); exiting so that Ray restarts this actor", reason)
    logging.shutdown()
    os._exit(1)
