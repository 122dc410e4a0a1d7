"""`AdapterRegistry`: the LoRA adapters one LLMServer replica serves, and which of them it holds.

Known adapters (name -> source, a local directory or a URI) come from the config's `lora_modules`, from
`POST /v1/load_lora_adapter` (on any replica, told to the others), and from `lora_dynamic_path` when a
request asks for `<base>:<name>`; /v1/models lists them. A replica holds an adapter (checked, read into its
ranks' host caches) from its first request on, through Serve's model multiplexing: the LLMServer hands in
its `serve.multiplexed` loader as `use`, so Serve's LRU of `max_num_models_per_replica` decides what is
held, evicts the least recently used (which unloads it from the ranks), and reports the held set to the
request router, which sends an adapter's requests where it is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from tandem.deploy.adapters.fetch import join, local_dir
from tandem.deploy.protocol.errors import OpenAIError, adapter_not_found, invalid_request, model_not_found
from tandem.deploy.protocol.model_names import parse_model
from tandem.scheduler.messages import LoRARequest

Use = Callable[[str], Awaitable[Any]]


class AdapterReplica(Protocol):
    """The part of `LLMReplica` the registry uses."""

    @property
    def lora_enabled(self) -> bool: ...

    async def check_lora(self, path: str) -> None: ...

    async def add_lora(self, name: str, path: str) -> LoRARequest: ...

    async def remove_lora(self, name: str) -> bool: ...

    def lora(self, name: str) -> LoRARequest | None: ...


class HeldAdapter:
    """What Serve's multiplexing keeps per held adapter; evicted, it unloads the adapter from the ranks.
    Serve calls a synchronous `__del__` in a worker thread, so the unload is handed to the replica's loop
    (once: the garbage collector calls `__del__` again later)."""

    def __init__(self, name: str, registry: AdapterRegistry, loop: asyncio.AbstractEventLoop) -> None:
        self.name, self._registry, self._loop = name, registry, loop
        self._released = False

    def __del__(self) -> None:
        if self._released:
            return
        self._released = True
        if self._loop.is_closed():  # the replica is gone, and its ranks with it
            return
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(self._registry.evicted(self.name), self._loop)


class AdapterRegistry:
    def __init__(
        self,
        replica: AdapterReplica,
        served_model_name: str,
        *,
        modules: dict[str, str] | None = None,
        dynamic_path: str | None = None,
        cache_dir: Path,
        use: Use | None = None,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self._replica = replica
        self.served = served_model_name
        self._sources: dict[str, str] = dict(modules or {})
        self._dynamic = dynamic_path
        self._cache = cache_dir
        self._use = use
        self._on_request = on_request
        self._created = int(time.time())
        self.requests: dict[str, int] = {}  # requests that named each adapter on this replica
        self._lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self._replica.lora_enabled

    def known(self) -> dict[str, str]:
        """name -> source of every adapter this replica serves by name."""
        return dict(self._sources)

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models entries: each adapter, with the base model as its `parent`."""
        return [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "tandem",
                "root": source,
                "parent": self.served,
            }
            for name, source in self._sources.items()
        ]

    # ---- requests --------------------------------------------------------------------------------
    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, held by this replica from now on; None for the base
        model. An unknown name is a 404 (OpenAI's model_not_found); a dynamic adapter that cannot be served
        a 400 naming why."""
        parsed = parse_model(model, self.served)
        name = parsed.adapter
        if name is None:
            return None
        assert model is not None
        if not self.enabled:
            raise self.not_found(model)
        if name not in self._sources:
            if not (parsed.qualified and self._dynamic is not None):
                raise self.not_found(model)
            await self._discover(name, model)
        self.requests[name] = self.requests.get(name, 0) + 1
        if self._on_request is not None:
            self._on_request(name)
        return await self.hold(name)

    def not_found(self, model: str) -> OpenAIError:
        """The 404 for a `model` this server does not serve, naming the base model and its adapters."""
        return model_not_found(model, self.served, list(self._sources), self._dynamic is not None)

    async def hold(self, name: str) -> LoRARequest:
        """Hold `name` on this replica (through Serve's multiplexing where it runs) and return it."""
        if self._use is not None:
            await self._use(name)
        lora = self._replica.lora(name)
        if lora is None:  # outside Serve, or Serve's handle outlived an unload: load it directly
            await self._read_into_replica(name)
            lora = self._replica.lora(name)
        assert lora is not None
        return lora

    async def _discover(self, name: str, model: str) -> None:
        assert self._dynamic is not None
        source = join(self._dynamic, name)
        try:
            local = await asyncio.to_thread(local_dir, source, self._cache)
        except FileNotFoundError:
            raise self.not_found(model) from None
        except (OSError, ImportError, ValueError) as exc:
            raise invalid_request(
                f"the LoRA adapter at {source!r} cannot be read: {exc}", param="model"
            ) from None
        if not local.is_dir():
            raise self.not_found(model)
        await self._check(str(local), "model")
        self._sources.setdefault(name, source)

    async def _check(self, path: str, param: str) -> None:
        try:
            await self._replica.check_lora(path)
        except ValueError as exc:
            raise invalid_request(str(exc), param=param) from None

    async def load_into_replica(self, name: str) -> HeldAdapter:
        """Serve's multiplexed loader: read `name` into this replica's ranks, until Serve lets it go."""
        await self._read_into_replica(name)
        return HeldAdapter(name, self, asyncio.get_running_loop())

    async def _read_into_replica(self, name: str) -> None:
        source = self._sources.get(name)
        if source is None:
            raise adapter_not_found(name)
        try:
            local = await asyncio.to_thread(local_dir, source, self._cache)
            await self._replica.add_lora(name, str(local))
        except (OSError, ImportError, ValueError) as exc:
            raise invalid_request(f"LoRA adapter {name!r} ({source}): {exc}", param="model") from None

    async def evicted(self, name: str) -> None:
        """Serve's multiplexing let `name` go: free the ranks' copy (running requests finish with it)."""
        await self._replica.remove_lora(name)

    # ---- run-time loading ------------------------------------------------------------------------
    async def load(self, name: str, source: str) -> None:
        """`POST /v1/load_lora_adapter`: check the adapter (a 400 naming what is wrong), serve it by
        `name`, and hold it here."""
        if not self.enabled:
            raise invalid_request("LoRA is not enabled on this server (--enable-lora)", param="lora_name")
        if not name or name == self.served or ":" in name:
            raise invalid_request(f"{name!r} cannot name a LoRA adapter", param="lora_name")
        async with self._lock:
            if name in self._sources:
                raise invalid_request(
                    f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            try:
                local = await asyncio.to_thread(local_dir, source, self._cache)
            except (OSError, ImportError, ValueError) as exc:
                raise invalid_request(
                    f"the LoRA adapter at {source!r} cannot be read: {exc}", param="lora_path"
                ) from None
            await self._check(str(local), "lora_path")
            self._sources[name] = source
        await self.hold(name)

    def learn(self, name: str, source: str) -> None:
        """Another replica loaded `name` at run time: serve it here too (checked there, read on use)."""
        self._sources.setdefault(name, source)

    async def unload(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter`: stop serving `name` (404 if it is not served)."""
        if self._sources.pop(name, None) is None:
            raise adapter_not_found(name)
        await self._replica.remove_lora(name)

    async def forget(self, name: str) -> None:
        """Another replica unloaded `name`."""
        if self._sources.pop(name, None) is not None:
            await self._replica.remove_lora(name)
