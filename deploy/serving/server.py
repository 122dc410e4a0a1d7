"""`LLMServer`: the app's only deployment, one replica per TP group, and its HTTP ingress.

A request crosses one Serve hop (proxy -> replica); the OpenAI routes, the request path
(`GenerationService`) and the `LLMReplica` all run in the replica's process, so a token goes from the
replica's zmq socket to the SSE stream without another actor call. Overload is handled in the app
(`Admission`), so it answers an OpenAI-shaped 503 rather than the proxy's plain-text one.

HTTP goes through the FastAPI app built per replica by `__serve_build_asgi_app__`. The handle methods
(`completions`, `chat_completions`, `stats`, `models`) take the same JSON bodies as the routes and return
the same dicts, errors included (`{"error": {...}}`, as the HTTP body would be). With
`handle.options(stream=True)` and `"stream": true` they yield the chunk dicts; a request that fails
before streaming yields its error dict alone. Serve's periodic `check_health` fails when any rank is
down, and Serve then replaces the replica together with its whole TP group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from ray import serve

from tandem.deploy.adapters.registry import AdapterRegistry
from tandem.deploy.generation.backend import ReplicaBackend
from tandem.deploy.generation.service import GenerationService
from tandem.deploy.guards.admission import Admission
from tandem.deploy.guards.auth import ApiKeys
from tandem.deploy.guards.limits import RequestLimits, prompt_chars_bound
from tandem.deploy.guards.shutdown import GateState
from tandem.deploy.observability.lora_metrics import LoraMetrics
from tandem.deploy.observability.metrics import ServingMetrics
from tandem.deploy.observability.replica_metrics import ReplicaMetrics
from tandem.deploy.observability.spec_metrics import SpecMetrics
from tandem.deploy.protocol.errors import OpenAIError, from_validation_errors
from tandem.deploy.protocol.harmony.chat import HarmonyChat
from tandem.deploy.protocol.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from tandem.deploy.routing.prefix_routing import ONGOING_STAT
from tandem.deploy.serving.http import build_http_app
from tandem.deploy.serving.openai_service import OpenAIService, Response

RequestT = TypeVar("RequestT", bound=BaseModel)

logger = logging.getLogger(__name__)
QUEUED_PER_RUNNING = 4  # the default queue bound: a few engine batches' worth of requests


def _default_replica(model: str | None, **kwargs: Any) -> Any:
    from tandem.engine.tiny import default_model_dir
    from tandem.replicas.llm_replica import LLMReplica

    # The demo model ships inside the package, so the node that serves it finds it in its own install.
    return LLMReplica(model if model is not None else str(default_model_dir()), **kwargs)


def _own_deployment_handle() -> Any:
    context = serve.get_replica_context()
    return serve.get_deployment_handle(context.deployment, context.app_name)


@serve.deployment
@serve.ingress()
class LLMServer:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        model: str | None,
        served_model_name: str,
        *,
        model_root: str | None = None,
        tp_size: int,
        device: str,
        engine: dict[str, Any],
        placement_strategy: str,
        cpus_per_rank: float,
        max_running: int | None,
        max_queued: int | None,
        stats_interval_s: float = 1.0,
        drain_timeout_s: float = 30.0,
        api_keys: ApiKeys | None = None,
        max_request_body_bytes: int | None = None,
        max_choices_per_request: int | None = None,
        prompt_chars_per_token: int | None = None,
        chat_template: str | None = None,
        stuck_rank_timeout_s: float | None = None,
        lora_modules: dict[str, str] | None = None,
        lora_dynamic_path: str | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = True,
        allowed_origins: list[str] | None = None,
        replica_factory: Callable[..., Any] | None = None,
    ) -> None:
        factory = replica_factory or _default_replica
        watchdog = {} if stuck_rank_timeout_s is None else {"stuck_rank_timeout_s": stuck_rank_timeout_s}
        self._replica: Any = factory(
            model,
            tp_size=tp_size,
            device=device,
            engine=engine,
            placement_strategy=placement_strategy,
            cpus_per_rank=cpus_per_rank,
            **watchdog,
        )
        await self._replica.start()
        self._metrics = ServingMetrics(served_model_name)
        # A gpt-oss model is always served in the harmony format (deploy/protocol/harmony).
        harmony = HarmonyChat.for_model(
            getattr(self._replica, "model_type", None), self._replica.tokenizer, reasoning_parser
        )
        if harmony is not None:
            chat_template = harmony.chat_template(chat_template, self._replica.tokenizer)
        # Token ids are checked against the model's vocabulary before they can reach a rank.
        generation = GenerationService(
            self._replica, self._metrics, vocab_size=self._replica.vocab_size, chat_template=chat_template
        )
        # Unset bounds follow the engine: run what it runs at once, queue a few batches more.
        running = max_running or self._replica.max_running
        queued = max_queued if max_queued is not None else QUEUED_PER_RUNNING * running
        self._admission = Admission(running, queued)
        backend = ReplicaBackend(generation, self._admission, _own_deployment_handle)
        self._replica_metrics = ReplicaMetrics(served_model_name, serve.get_replica_context().replica_tag)
        limits = RequestLimits(
            max_choices=max_choices_per_request or RequestLimits.max_choices,
            max_prompt_chars=None
            if prompt_chars_per_token is None
            else prompt_chars_bound(self._replica.max_model_len, prompt_chars_per_token),
        )
        self._adapters: AdapterRegistry | None = None
        self._lora_metrics: LoraMetrics | None = None
        self._spec_metrics = SpecMetrics(served_model_name)  # records once the ranks report drafts
        if getattr(self._replica, "lora_enabled", False):
            self._lora_metrics = LoraMetrics(served_model_name)
            self._adapters = await self._adapter_registry(
                served_model_name, lora_modules or {}, lora_dynamic_path, backend
            )
        self._service = OpenAIService(
            backend,
            served_model_name,
            model_root,
            outcomes=self._replica_metrics,
            limits=limits,
            adapters=self._adapters,
            announce=backend.announce,
            reasoning_parser=reasoning_parser,
            harmony=harmony,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
        )
        self._allowed_origins = allowed_origins or []
        self._api_keys = api_keys
        self._max_request_body_bytes = max_request_body_bytes
        self._gate = GateState()
        self._drain_timeout_s = drain_timeout_s
        self._poller = asyncio.create_task(self._poll_stats(stats_interval_s))

    async def _adapter_registry(
        self, served: str, modules: dict[str, str], dynamic_path: str | None, backend: ReplicaBackend
    ) -> AdapterRegistry:
        """The replica's adapters: the configured ones, those the running replicas learned at run time
        (so a replica that replaces another loses none), held through Serve's model multiplexing: its LRU
        holds as many as the ranks' host caches do."""
        options = self._replica.options
        held = options.max_cpu_loras or 2 * options.engine.max_loras
        cache = Path(tempfile.gettempdir()) / "tandem-lora" / served.replace("/", "--")
        registry: AdapterRegistry

        async def load(name: str) -> Any:
            return await registry.load_into_replica(name)

        registry = AdapterRegistry(
            self._replica,
            served,
            modules=modules,
            dynamic_path=dynamic_path,
            cache_dir=cache,
            use=serve.multiplexed(max_num_models_per_replica=held)(load),
            on_request=self._lora_metrics.request if self._lora_metrics is not None else None,
        )
        for known in await backend.gather("lora_adapters"):
            for name, source in dict(known).items():
                registry.learn(name, source)
        return registry

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(
            self._service,
            self._api_keys,
            self._max_request_body_bytes,
            self._gate,
            allowed_origins=self._allowed_origins,
        )

    # ---- the handle API (public: callers outside tandem use it) ----------------------------------------
    async def completions(
        self, body: dict[str, Any]
    ) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        return await self._handle_call(body, "/v1/completions")

    async def chat_completions(
        self, body: dict[str, Any]
    ) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        return await self._handle_call(body, "/v1/chat/completions")

    async def stats(self) -> dict[str, Any]:
        """The `LLM.stats()` keys summed over every replica, plus `num_replicas`."""
        return await self._service.stats()

    async def models(self) -> dict[str, Any]:
        return self._service.models()

    async def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/load_lora_adapter` for handle callers: `{"status": ...}` or an error dict."""
        return await self._admin(body, LoadLoraAdapterRequest, self._service.load_lora_adapter)

    async def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._admin(body, UnloadLoraAdapterRequest, self._service.unload_lora_adapter)

    # ---- adapters between replicas (broadcast targets) -------------------------------------------
    async def lora_adapters(self) -> dict[str, str]:
        """name -> source of every adapter this replica serves (a new replica adopts its peers')."""
        return self._adapters.known() if self._adapters is not None else {}

    async def learn_lora_adapter(self, name: str, source: str) -> None:
        if self._adapters is not None:
            self._adapters.learn(name, source)

    async def forget_lora_adapter(self, name: str) -> None:
        if self._adapters is not None:
            await self._adapters.forget(name)

    # ---- per replica: broadcast targets and Serve's hooks -----------------------------------------
    async def replica_stats(self) -> dict[str, Any]:
        stats = dict(await self._replica.stats())
        stats["max_ongoing_requests"] = self._admission.max_running
        stats["max_queued_requests"] = self._admission.max_queued
        stats["replica"] = serve.get_replica_context().replica_tag
        if self._adapters is not None:  # which adapters this replica holds, and its requests for each
            stats["lora_held"] = sorted(lora.name for lora in self._replica.loras())
            stats["lora_requests"] = dict(self._adapters.requests)
        return stats

    async def check_health(self) -> None:
        await self._replica.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the request router each period: this replica's running and queued requests
        (HAProxy's traffic never passes the router, so it has no count of its own there)."""
        return {ONGOING_STAT: self._admission.running + self._admission.waiting}

    # ---- draining, driven by `tandem serve` on SIGTERM (deploy/guards/shutdown.py) ------------------------
    async def begin_drain(self) -> None:
        """Turn new HTTP requests away (503); those in flight go on."""
        self._gate.close()

    async def in_flight(self) -> int:
        return self._gate.in_flight

    async def end_drain(self) -> None:
        """End what is still running with an error event, stop the ranks, and wait (briefly) until the
        error events are sent."""
        await self._replica.shutdown(drain_timeout_s=0.0)
        await self._gate.wait_idle(timeout_s=5.0)

    async def _call(self, body: dict[str, Any], path: str) -> Response:
        streaming = isinstance(body, dict) and body.get("stream") is True
        try:
            return await self._service.answer(path, body)
        except OpenAIError as error:
            # Serve needs a generator for a stream=True call and a plain value otherwise.
            return _yield_once(error.body()) if streaming else error.body()

    async def _admin(
        self, body: dict[str, Any], request_cls: type[RequestT], method: Callable[[RequestT], Awaitable[str]]
    ) -> dict[str, Any]:
        try:
            return {"status": await method(request_cls.model_validate(body))}
        except ValidationError as exc:
            return from_validation_errors(exc.errors()).body()
        except OpenAIError as exc:
            return exc.body()

    async def _handle_call(
        self, body: dict[str, Any], path: str
    ) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        result = await self._call(body, path)
        return result if isinstance(result, dict) else _one_by_one(result)

    async def _poll_stats(self, interval_s: float) -> None:
        # Gauges (running, waiting, KV usage) are sampled, not updated per step: one stats call a second
        # costs the ranks nothing measurable.
        while True:
            try:
                stats = await self._replica.stats()
                self._metrics.engine_stats(stats)
                if self._lora_metrics is not None:
                    self._lora_metrics.sample(stats, held=len(self._replica.loras()))
                self._spec_metrics.sample(stats)
                line = self._spec_metrics.console_line(stats, time.monotonic())
                if line is not None:  # stdout: Ray forwards it to the `tandem serve` console at any level
                    print(line, flush=True)
                self._replica_metrics.sample(self._admission.running, self._admission.waiting, stats)
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
            # A constructor that failed part-way (a rank that could not start) set no drain timeout.
            await replica.shutdown(drain_timeout_s=getattr(self, "_drain_timeout_s", 0.0))


async def _yield_once(item: dict[str, Any]) -> AsyncGenerator[list[dict[str, Any]], None]:
    yield [item]


async def _one_by_one(
    batches: AsyncGenerator[list[dict[str, Any]], None],
) -> AsyncGenerator[dict[str, Any], None]:
    """A handle stream yields chunk dicts one at a time (the public contract), not the service's batches."""
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for chunk in batch:
                yield chunk
