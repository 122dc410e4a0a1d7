"""`GET /metrics` on the API port, as vLLM and SGLang serve theirs: tandem's series, read from Ray's metrics
exporter on the replica's own node and filtered to the `ray_tandem_*` families.

The metrics are recorded once, through `ray.util.metrics` (metrics.py), and Ray's exporter is where every
Prometheus setup for Ray already scrapes; the API port shows the same names, labels and values for the
node it runs on, so the Grafana dashboard reads either. On a cluster of several nodes, a scrape of the API
port sees one node's replicas (whichever the request reached): scrape Ray's port on every node for all.
"""

from __future__ import annotations

import asyncio
import urllib.request

from tandem.deploy.observability.metrics import EXPORTED_PREFIX

TANDEM_FAMILY_PREFIX = EXPORTED_PREFIX + "tandem_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FETCH_TIMEOUT_S = 5.0


def tandem_families(exposition: str) -> str:
    """The `ray_tandem_*` families of a Prometheus text exposition, with their HELP and TYPE lines."""
    kept = []
    for line in exposition.splitlines():
        name = line.split()[2] if line.startswith(("# HELP ", "# TYPE ")) and len(line.split()) > 2 else line
        if name.startswith(TANDEM_FAMILY_PREFIX):
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")


def node_metrics_port() -> int | None:
    """The metrics export port of the Ray node this process runs on, or None outside Ray."""
    import ray

    if not ray.is_initialized():
        return None
    node = getattr(ray._private.worker.global_worker, "node", None)
    port = getattr(node, "metrics_export_port", None)
    return int(port) if port else None


async def node_tandem_metrics() -> str:
    """tandem's series as this node's Ray exporter has them; raises OSError when it cannot be read."""
    port = node_metrics_port()
    if port is None:
        raise OSError("no Ray metrics exporter on this node")

    def fetch() -> str:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            return str(response.read().decode("utf-8", "replace"))

    return tandem_families(await asyncio.to_thread(fetch))
