"""Serving metrics (the public metric names) through `ray.util.metrics`, recorded by each LLMServer replica.

Ray's exporter prefixes every application metric with `ray_`, so Prometheus scrapes
`ray_tandem_time_to_first_token_seconds` etc. on Ray's metrics export port. Ray adds its own tags
(WorkerId, NodeAddress, ...); ours is `model_name`. Gauges are per replica: sum them in queries.

Latencies are measured from the request's arrival at the replica (its HTTP route or handle method), so
they include the replica's admission queue but not the proxy. Negative spans are clamped to 0.
"""

from __future__ import annotations

from typing import Any, Protocol

METRIC_NAMES: tuple[str, ...] = (
    "tandem_time_to_first_token_seconds",
    "tandem_inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds",
    "tandem_request_queue_time_seconds",
    "tandem_num_requests_running",
    "tandem_num_requests_waiting",
    "tandem_kv_cache_usage_ratio",
    "tandem_prefix_cache_hit_tokens_total",
    "tandem_prompt_tokens_total",
    "tandem_generation_tokens_total",
    "tandem_cached_prompt_tokens_total",
)
EXPORTED_PREFIX = "ray_"  # what Ray's Prometheus exporter puts in front of each name

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0]


class MetricsSink(Protocol):
    """What the generation path reports; `ServingMetrics` in a replica, `NullMetrics` in unit tests."""

    def queue_time(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, tokens: int) -> None: ...
    def request_done(self, seconds: float) -> None: ...
    def prompt_tokens(self, count: int) -> None: ...
    def generation_tokens(self, count: int) -> None: ...
    def cached_tokens(self, count: int) -> None: ...
    def engine_stats(self, stats: dict[str, Any]) -> None: ...


class NullMetrics:
    def queue_time(self, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float, tokens: int) -> None:
        pass

    def request_done(self, seconds: float) -> None:
        pass

    def prompt_tokens(self, count: int) -> None:
        pass

    def generation_tokens(self, count: int) -> None:
        pass

    def cached_tokens(self, count: int) -> None:
        pass

    def engine_stats(self, stats: dict[str, Any]) -> None:
        pass


class ServingMetrics:
    """The tandem serving metrics of one replica, tagged with the served model name."""

    def __init__(self, model_name: str) -> None:
        from ray.util import metrics

        tags = ("model_name",)
        self._tags = {"model_name": model_name}

        def histogram(name: str, description: str, buckets: list[float]) -> metrics.Histogram:
            return metrics.Histogram(name, description=description, boundaries=buckets, tag_keys=tags)

        def gauge(name: str, description: str) -> metrics.Gauge:
            return metrics.Gauge(name, description=description, tag_keys=tags)

        def counter(name: str, description: str) -> metrics.Counter:
            return metrics.Counter(name, description=description, tag_keys=tags)

        self._ttft = histogram(METRIC_NAMES[0], "Arrival to first output token.", _LATENCY_BUCKETS)
        self._itl = histogram(METRIC_NAMES[1], "Time between output tokens of a choice.", _ITL_BUCKETS)
        self._e2e = histogram(METRIC_NAMES[2], "Arrival to the last output token.", _E2E_BUCKETS)
        self._queue = histogram(METRIC_NAMES[3], "Ingress arrival to start on a replica.", _LATENCY_BUCKETS)
        self._running = gauge(METRIC_NAMES[4], "Requests in the replica's running batch.")
        self._waiting = gauge(METRIC_NAMES[5], "Requests waiting in the replica's scheduler.")
        self._kv_usage = gauge(METRIC_NAMES[6], "Fraction of KV pages held by live requests.")
        self._prefix_hits = counter(METRIC_NAMES[7], "Prompt tokens served from the prefix cache.")
        self._prompt = counter(METRIC_NAMES[8], "Prompt tokens admitted.")
        self._generation = counter(METRIC_NAMES[9], "Tokens generated.")
        self._cached = counter(METRIC_NAMES[10], "Prompt tokens the prefix cache supplied.")
        self._last_prefix_hits: int | None = None

    def queue_time(self, seconds: float) -> None:
        self._queue.observe(max(seconds, 0.0), tags=self._tags)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(seconds, 0.0), tags=self._tags)

    def inter_token(self, seconds: float, tokens: int) -> None:
        # One observation per delta, never per token: a delta carries every token since the consumer
        # last read, and its gap spread over them is the inter-token latency a client saw.
        if tokens > 0:
            self._itl.observe(max(seconds, 0.0) / tokens, tags=self._tags)

    def request_done(self, seconds: float) -> None:
        self._e2e.observe(max(seconds, 0.0), tags=self._tags)

    def prompt_tokens(self, count: int) -> None:
        if count > 0:
            self._prompt.inc(count, tags=self._tags)

    def generation_tokens(self, count: int) -> None:
        if count > 0:
            self._generation.inc(count, tags=self._tags)

    def cached_tokens(self, count: int) -> None:
        """Per request, as `usage.prompt_tokens_details.cached_tokens` counts it."""
        if count > 0:
            self._cached.inc(count, tags=self._tags)

    def engine_stats(self, stats: dict[str, Any]) -> None:
        """Gauges and the prefix-hit counter from one `LLMReplica.stats()` snapshot."""
        self._running.set(float(stats.get("num_running", 0)), tags=self._tags)
        self._waiting.set(float(stats.get("num_waiting", 0)), tags=self._tags)
        total = float(stats.get("kv_pages_total", 0) or 0)
        used = float(stats.get("kv_pages_used", 0) or 0)
        self._kv_usage.set(used / total if total > 0 else 0.0, tags=self._tags)
        hits = int(stats.get("prefix_cache_hit_tokens", 0) or 0)
        # The stats counter is cumulative; Ray's Counter wants increments. A drop means a restart.
        previous = self._last_prefix_hits
        if previous is not None and hits > previous:
            self._prefix_hits.inc(hits - previous, tags=self._tags)
        elif previous is None and hits > 0:
            self._prefix_hits.inc(hits, tags=self._tags)
        self._last_prefix_hits = hits
