"""Speculative-decoding metrics of an LLMServer replica (vLLM's names), kept apart from the serving
metrics because they exist only with `speculative_config` on: draft tokens proposed and accepted, and
accepted tokens per draft position, sampled from the ranks' cumulative stats and turned into increments;
and the periodic console line with the mean acceptance length (as vLLM's "SpecDecoding metrics" line)."""

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


# Seconds between two console lines (vLLM's stats interval); a line only when drafts were verified since.
LOG_INTERVAL_S = 10.0


def acceptance_line(now: dict[str, Any], before: dict[str, Any]) -> str | None:
    """The console line over the interval from `before` to `now` (two cumulative snapshots); None when no
    draft was verified in it. Mean acceptance length: tokens emitted per drafted row (accepted + 1)."""
    drafts = int(now.get(_COUNTED[0], 0) or 0) - int(before.get(_COUNTED[0], 0) or 0)
    if drafts <= 0:
        return None
    tokens = int(now.get(_COUNTED[1], 0) or 0) - int(before.get(_COUNTED[1], 0) or 0)
    accepted = int(now.get(_COUNTED[2], 0) or 0) - int(before.get(_COUNTED[2], 0) or 0)
    old = list(before.get("spec_decode_num_accepted_tokens_per_pos") or ())
    new = list(now.get("spec_decode_num_accepted_tokens_per_pos") or ())
    old += [0] * (len(new) - len(old))
    per_pos = ", ".join(f"{(n - o) / drafts:.2f}" for n, o in zip(new, old, strict=False))
    return (
        f"tandem: speculative decoding: mean acceptance length {1 + accepted / drafts:.2f}, "
        f"accepted {accepted} of {tokens} draft tokens ({100 * accepted / max(tokens, 1):.1f}%), "
        f"per-position acceptance rate {per_pos}"
    )


class SpecMetrics:
    """Registers its counters with the first snapshot that has drafts, so a replica without
    `speculative_config` exports none of them."""

    def __init__(self, model_name: str) -> None:
        self._tags = {"model_name": model_name}
        self._counters: dict[str, Any] = {}
        self._per_pos: Any = None
        self._last: dict[str, int] = {}
        self._logged: dict[str, Any] = {}  # the snapshot at the last console line
        self._logged_at: float | None = None

    def console_line(self, stats: dict[str, Any], now: float) -> str | None:
        """The line to print at wall time `now` (seconds), once per LOG_INTERVAL_S with new drafts."""
        if _COUNTED[0] not in stats:
            return None
        if self._logged_at is None:  # the first snapshot starts the first interval
            self._logged, self._logged_at = dict(stats), now
            return None
        if now - self._logged_at < LOG_INTERVAL_S:
            return None
        line = acceptance_line(stats, self._logged)
        self._logged, self._logged_at = dict(stats), now
        return line

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
