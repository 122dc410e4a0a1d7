"""Multi-LoRA across two replicas over real HTTP through HAProxy (lora_cluster.py, a process of its own):
four adapters, three configured and one loaded at run time; each adapter's repeated requests land on one
replica (over HTTP through HAProxy's route hook, and through the handle), no adapter is read by more than
one replica, adapters change the output, and after the replica holding the run-time adapter is killed and
replaced, every adapter is still served (the new replica adopts the run-time one from its peer) with the
same greedy text, and each adapter's requests land on one replica again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUN_TIMEOUT_S = 600
ADAPTERS = ["alpha", "beta", "gamma", "delta"]


def _run(tmp_path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    out = tmp_path / "lora-e2e.json"
    script = Path(__file__).with_name("lora_cluster.py")
    done = subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0 and out.is_file(), done.stderr[-4000:]
    return dict(json.loads(out.read_text()))


def _one_replica_each(stats: dict[str, dict[str, Any]]) -> dict[str, str]:
    where: dict[str, str] = {}
    for adapter in ADAPTERS:
        serving = [tag for tag, s in stats.items() if s["requests"].get(adapter, 0) > 0]
        assert len(serving) == 1, (adapter, stats)
        where[adapter] = serving[0]
    return where


def test_adapters_stick_to_replicas_and_survive_a_replica_restart(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result["load"][0] == 200, result["load"]
    assert result["bad_load"][0] == 400 and "not a directory" in result["bad_load"][1]
    before, after = result["before"], result["after"]
    assert before["errors"] == [] and after["errors"] == [], (before["errors"], after["errors"])
    # Each adapter's requests, HTTP and handle alike, went to one replica; each adapter was read by it only.
    where = _one_replica_each(result["stats_before"])
    for adapter, tag in where.items():
        holders = [t for t, s in result["stats_before"].items() if adapter in s["held"]]
        assert holders == [tag], (adapter, result["stats_before"])
    texts = before["texts"]
    assert all(texts[a] != texts["tiny"] for a in ADAPTERS)  # the adapters change the output
    assert all(texts[f"handle:{a}"][0] == texts[a][0] for a in ADAPTERS)
    # The replica holding the run-time adapter was replaced; nothing was lost.
    assert result["replaced"]
    assert all(models == sorted(["tiny", *ADAPTERS]) for models in result["models_after"]), result[
        "models_after"
    ]
    assert after["texts"] == before["texts"]
    _one_replica_each(result["stats_after"])
