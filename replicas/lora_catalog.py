"""The LoRA adapters one model copy serves by name: each checked against the base model once, when it is
added, and given the id its ranks key their caches and slots by."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from tandem.engine.config import ModelConfig
from tandem.engine.lora.peft_format import read_adapter
from tandem.scheduler.messages import LoRARequest


class LoraCatalog:
    """name -> `LoRARequest`. `add` raises ValueError (an `AdapterError`) naming what is wrong with an
    adapter: a missing path, a config field tandem does not apply, shapes of another model, a rank over
    `max_lora_rank`. Thread-safe: adds run off the event loop, since they read files."""

    def __init__(self, model_config: ModelConfig, max_lora_rank: int, enabled: bool) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.enabled = enabled
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def check(self, path: str) -> None:
        """Raise ValueError if the adapter at `path` cannot be served on this model."""
        if not self.enabled:
            raise ValueError(
                "LoRA adapters need enable_lora=True (tandem serve: --enable-lora or --lora-modules)"
            )
        read_adapter(path, self.model_config, self.max_lora_rank)

    def add(self, name: str, path: str) -> tuple[LoRARequest, bool]:
        """The adapter under `name`, checked and registered: (its request, whether it is new). The same
        name at the same path again is the one already there; at another path it is a ValueError."""
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        resolved = str(Path(path).expanduser())
        with self._lock:
            known = self._by_name.get(name)
        if known is not None:
            if known.path == resolved:
                return known, False
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded (from {known.path!r})")
        self.check(resolved)
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:  # added meanwhile by another caller
                return known, False
            lora = LoRARequest(name, next(self._ids), resolved)
            self._by_name[name] = lora
        return lora, True

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
