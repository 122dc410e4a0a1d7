"""Speculative-decoding metrics of an LLMServer replica (vLLM's names), kept apart from the serving
metrics because they exist only with `speculative_config` on: draft tokens proposed and accepted, and
accepted tokens per draft position, sampled from the ranks' cumulative stats and turned into increments."""

from __future__ import annotations

from typing import Any

SPEC_METRIC_NAMES: tuple[str, ...] = (
    "tandem_spec_decode_num_drafts_total",
    "tandem_spec_decode_num_draft_tokens_total",
    "tandem_spec_decode_num_accepted_tokens_total",
    "tandem_spec_decode_num_accepted_tokens_per_pos_total",
)
# The ranks' cumulative counters behind the first three metrics.
_COUNTED = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
_DESCRIPTIONS = (
    "Rows verified with at least one draft token.",
    "Draft tokens proposed and verified.",
    "Draft tokens accepted.",
    "Draft tokens accepted, by position in the draft (0 first).",
)


class SpecMetrics:
    """Registers its counters with the first snapshot that has drafts, so a replica without
    `speculative_config` exports none of them."""

    def __init__(self, model_name: str) -> None:
        self._tags = {"model_name": model_name}
        self._counters: dict[str, Any] = {}
        self._per_pos: Any = None
        self._last: dict[str, int] = {}

    def sample(self, stats: dict[str, Any]) -> None:
        """From one `LLMReplica.stats()` snapshot (rank 0's: every rank verifies the same drafts)."""
        if _COUNTED[0] not in stats:
            return
        if not self._counters:
            from ray.util import metrics

            for key, name, doc in zip(_COUNTED, SPEC_METRIC_NAMES, _DESCRIPTIONS, strict=False):
                self._counters[key] = metrics.Counter(name, description=doc, tag_keys=("model_name",))
            self._per_pos = metrics.Counter(
                SPEC_METRIC_NAMES[3], description=_DESCRIPTIONS[3], tag_keys=("model_name", "position")
            )
        for key, counter in self._counters.items():
            self._increment(key, int(stats.get(key, 0) or 0), counter, self._tags)
        for position, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            tags = {**self._tags, "position": str(position)}
            self._increment(f"pos{position}", int(value), self._per_pos, tags)

    def _increment(self, key: str, value: int, counter: Any, tags: dict[str, str]) -> None:
        previous = self._last.get(key)
        # A drop means the ranks restarted: their count starts again from zero.
        step = value - previous if previous is not None and value >= previous else value
        if step > 0:
            counter.inc(step, tags=tags)
        self._last[key] = value
