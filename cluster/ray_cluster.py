"""Connect to Ray, or start a local cluster, without clobbering one the user already has."""

from __future__ import annotations

from typing import Any

import ray

from tandem.engine.environment import ray_address


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> bool:
    """Make sure this process is connected to Ray. Returns True if this call started the connection.

    An existing connection is kept as it is. Otherwise `address` (or RAY_ADDRESS) joins a running
    cluster; with neither, `ray.init` joins a local cluster if one runs on this node, else starts one.
    """
    if ray.is_initialized():
        return False
    address = address or ray_address()
    ray.init(address=address, ignore_reinit_error=True, **init_kwargs)
    return True


def cluster_resources_summary() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    parts = [f"{k}: {free.get(k, 0):g}/{v:g} free" for k, v in sorted(total.items()) if k in ("CPU", "GPU")]
    return ", ".join(parts) or "no CPU or GPU resources"
