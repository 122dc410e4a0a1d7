"""`LLMServer`: the Serve deployment around one `LLMReplica` (one TP group of rank actors).

Thin on purpose: the request path lives in `GenerationService`, the metrics in `ServingMetrics`. Serve
places each replica in a placement group of `tp_size` bundles (see `app.py`); the LLMReplica starts its
rank actors inside it. Serve's periodic `check_health` fails when any rank is down, and Serve then
replaces the replica together with its whole TP group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ray import serve

from tandem.deploy.generation import GenerationService
from tandem.deploy.jobs import GenerateJob, JobEvent
from tandem.deploy.metrics import ServingMetrics

logger = logging.getLogger(__name__)


def _default_replica(model: str | None, **kwargs: Any) -> Any:
    from tandem.engine.tiny import default_model_dir
    from tandem.replicas.llm_replica import LLMReplica

    # The embedded tiny model is built on (and cached by) the node that serves it.
    return LLMReplica(model if model is not None else str(default_model_dir()), **kwargs)


@serve.deployment
class LLMServer:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        model: str | None,
        served_model_name: str,
        *,
        tp_size: int,
        device: str,
        engine: dict[str, Any],
        placement_strategy: str,
        cpus_per_rank: float,
        stats_interval_s: float = 1.0,
        drain_timeout_s: float = 30.0,
        replica_factory: Callable[..., Any] | None = None,
    ) -> None:
        factory = replica_factory or _default_replica
        self._replica: Any = factory(
            model,
            tp_size=tp_size,
            device=device,
            engine=engine,
            placement_strategy=placement_strategy,
            cpus_per_rank=cpus_per_rank,
        )
        await self._replica.start()
        self._metrics = ServingMetrics(served_model_name)
        # Token ids are checked against the model's vocabulary before they can reach a rank.
        self._service = GenerationService(self._replica, self._metrics, vocab_size=self._replica.vocab_size)
        self._drain_timeout_s = drain_timeout_s
        self._poller = asyncio.create_task(self._poll_stats(stats_interval_s))

    async def generate(self, job: GenerateJob) -> AsyncGenerator[JobEvent, None]:
        """`JobAccepted`/`JobRejected`, then the choices' deltas. Cancelling the call aborts the job."""
        async for event in self._service.run(job):
            yield event

    async def stats(self) -> dict[str, Any]:
        return dict(await self._replica.stats())

    async def check_health(self) -> None:
        await self._replica.check_health()

    async def _poll_stats(self, interval_s: float) -> None:
        # Gauges (running, waiting, KV usage) are sampled, not updated per step: one stats call a second
        # costs the ranks nothing measurable.
        while True:
            try:
                self._metrics.engine_stats(await self._replica.stats())
            except asyncio.CancelledError:
                raise
            except Exception:  # a dead rank shows up in check_health; keep the poller alive
                logger.debug("stats poll failed", exc_info=True)
            await asyncio.sleep(interval_s)

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown (it accepts an async __del__): drain, then stop the ranks.
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        replica = getattr(self, "_replica", None)
        if replica is not None:
            await replica.shutdown(drain_timeout_s=self._drain_timeout_s)
