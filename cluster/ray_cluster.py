"""Connect to Ray, or start a local cluster, without clobbering one the user already has."""

from __future__ import annotations

from typing import Any

import ray

from tandem.engine.environment import ray_address


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None, **init_kwargs: Any) -> bool:
    """Make sure this process is connected to Ray. Returns True if this call started the connection.

    An existing connection is kept as it is. Otherwise `address` (or RAY_ADDRESS) joins a running
    cluster; with neither, it joins a `ray start` cluster of this node, else starts a local one, with
    `num_cpus` logical CPUs when given (a joined cluster keeps its own).
    """
    if ray.is_initialized():
        return False
    address = address or ray_address() or local_cluster_address()
    if address is None and num_cpus is not None:
        init_kwargs["num_cpus"] = num_cpus
    ray.init(address=address, ignore_reinit_error=True, **init_kwargs)
    return True


def local_cluster_address() -> str | None:
    """The address of a `ray start` cluster running on this node, or None."""
    try:
        from ray._private.services import find_bootstrap_address

        found = find_bootstrap_address(None)
        return str(found) if found else None
    except Exception:  # a private API: if it moves, starting a local cluster is the safe fallback
        return None


def cluster_can_grow() -> bool:
    """Whether an autoscaler may add nodes (a node type whose max exceeds its min), as Ray Data judges
    it; a cluster of `ray.init` or `ray start` alone cannot grow."""
    try:
        from ray.data._internal.cluster_autoscaler.util import is_autoscaling_enabled
    except ImportError:  # a private API: if it moves, assume it may grow, and wait as Ray does
        return True
    return bool(is_autoscaling_enabled())


def cluster_resources_summary() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    parts = [f"{k}: {free.get(k, 0):g}/{v:g} free" for k, v in sorted(total.items()) if k in ("CPU", "GPU")]
    return ", ".join(parts) or "no CPU or GPU resources"
