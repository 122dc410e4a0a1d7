"""Prefix-cache-aware routing over real HTTP through the default ingress (HAProxy), against Serve's default
router and against one replica serving everything, in one run.

The run is `benchmarks/prefix_routing.py --preset cpu` as a subprocess: the ingress mode is a setting of
Ray's processes, read when they start, so the run needs a Ray of its own. Two replicas of the tiny model,
each with 1 200 tokens of KV (about six of the eight ~200-token prefixes; the single replica has both
replicas' KV), 192 requests interleaved over the prefixes, 8 at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUN_TIMEOUT_S = 600


def _run(out: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    command = [sys.executable, "-m", "tandem.benchmarks.prefix_routing", "--preset", "cpu", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0 and out.is_file(), done.stderr[-4000:]
    return dict(json.loads(out.read_text()))


def test_prefix_routing_keeps_the_cache_hits_of_one_replica(tmp_path: Path) -> None:
    result = _run(tmp_path / "prefix-routing.json")
    phases = result["phases"]
    for name, replicas in (("single", 1), ("routed", 2), ("default", 2)):
        phase = phases[name]
        assert phase["errors"] == [] and phase["num_replicas"] == replicas, (name, phase)
        # Every request went to this phase's fresh replicas: their own hit counters saw what the usage
        # objects report (a request waiting for pages is counted once, when admitted).
        assert phase["usage_hit_tokens"] == phase["replica_hit_tokens"]
    single, routed, default = (phases[n]["cached_tokens"] for n in ("single", "routed", "default"))
    assert routed >= 0.8 * single, (routed, single)
    assert routed >= 1.2 * default, (routed, default)
    assert set(result) >= {"device", "commit", "hit_ratio_routed", "hit_ratio_default", "ttft_p50_ms_routed"}
