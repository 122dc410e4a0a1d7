"""LoRA metrics of an LLMServer replica (docs/metrics.md), kept apart from the serving metrics because
they exist only with LoRA on: adapters held and in GPU slots, slot loads and evictions (sampled from the
ranks' stats each second, cumulative counts turned into increments), and requests per adapter."""

from __future__ import annotations

from typing import Any

LORA_METRIC_NAMES: tuple[str, ...] = (
    "tandem_lora_requests_total",
    "tandem_lora_adapters_held",
    "tandem_lora_adapters_in_slots",
    "tandem_lora_slot_loads_total",
    "tandem_lora_slot_evictions_total",
)
# The ranks' cumulative counters behind the two counters above.
_COUNTED = (("lora_loads", 3), ("lora_evictions", 4))


class LoraMetrics:
    def __init__(self, model_name: str) -> None:
        from ray.util import metrics

        self._tags = {"model_name": model_name}
        self._requests = metrics.Counter(
            LORA_METRIC_NAMES[0],
            description="Generate requests that named a LoRA adapter, by adapter.",
            tag_keys=("model_name", "lora_name"),
        )
        self._held = metrics.Gauge(
            LORA_METRIC_NAMES[1],
            description="LoRA adapters the replica holds (read into its ranks), as Serve's multiplexing "
            "reports them to the router.",
            tag_keys=("model_name",),
        )
        self._in_slots = metrics.Gauge(
            LORA_METRIC_NAMES[2], description="LoRA adapters in the GPU slots.", tag_keys=("model_name",)
        )
        self._counters = {
            key: metrics.Counter(
                LORA_METRIC_NAMES[i],
                description="Adapter copies into a GPU slot."
                if key == "lora_loads"
                else "Adapters replaced in a GPU slot by another.",
                tag_keys=("model_name",),
            )
            for key, i in _COUNTED
        }
        self._last: dict[str, int] = {}

    def request(self, lora_name: str) -> None:
        self._requests.inc(1, tags={**self._tags, "lora_name": lora_name})

    def sample(self, stats: dict[str, Any], held: int) -> None:
        """From one `LLMReplica.stats()` snapshot (rank 0's: every rank holds the same slots)."""
        self._held.set(float(held), tags=self._tags)
        self._in_slots.set(float(stats.get("lora_slots_used", 0) or 0), tags=self._tags)
        for key, counter in self._counters.items():
            value = int(stats.get(key, 0) or 0)
            previous = self._last.get(key)
            step = value - previous if previous is not None and value >= previous else value
            if step > 0:
                counter.inc(step, tags=self._tags)
            self._last[key] = value
