"""The Ray `tandem serve` runs on: a cluster it joins, or a local one it starts and owns.

A local one is this server's alone: its HTTP port is held (answering `loading`) before Ray starts, so a
taken port is refused at once; the other ports tandem picks for it are free ones, never Ray's fixed
ones; its HAProxy files live in a `tandem-*` folder of its own. `LocalRay.stop()` takes all of it down:
Ray, any process of it that outlives `ray.shutdown()` (an orphaned HAProxy, say), and the folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.ray_cluster import local_cluster_address
from tandem.deploy.cli.processes import ProcessTree, port_holder, stop_processes_naming
from tandem.deploy.cli.server_ports import LoadingListener
from tandem.deploy.config.args import AppArgs
from tandem.deploy.routing.ingress_mode import (
    free_port,
    haproxy_wrapper_environment,
    ray_environment,
    resolve_ingress,
)
from tandem.engine.environment import ray_address

# Serve's controller warns that a replica bound to one host "won't accept connections from HAProxy on
# other nodes": true of a cluster, noise on the one node a local Ray has.
_ONE_NODE_NOISE = "cross-node routing will fail"


class PortTaken(Exception):
    """The HTTP port cannot be bound: said at once, before Ray starts."""


@dataclass
class LocalRay:
    """What a Ray started by this command owns on its host."""

    state_dir: str
    listener: LoadingListener
    processes: ProcessTree = field(default_factory=ProcessTree)

    def stop(self) -> list[str]:
        """Ray down, every process of it gone, the state folder removed; describe what had to be killed."""
        import ray

        self.listener.close()
        self.processes.snapshot()
        ray.shutdown()
        # An HAProxy reload during the shutdown starts processes the snapshot never saw; ours are the ones
        # whose command line names this server's own directory.
        killed = self.processes.stop_leftovers() + stop_processes_naming(self.state_dir)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return killed


def join_existing(address: str | None, ingress: str, log_level: str) -> bool:
    """Join the given / RAY_ADDRESS / `ray start` cluster; False when there is none to join. A joined
    cluster keeps the ingress mode its nodes were started with (see ingress_mode.py)."""
    import ray

    existing = address or ray_address() or local_cluster_address()
    if not existing:
        return False
    try:
        ray.init(address=existing, logging_level=logging.getLevelName(log_level))
    except ConnectionError:
        if address:
            raise
        return False
    print(f"tandem: joined the Ray cluster at {existing}", file=sys.stderr, flush=True)
    if ingress != "auto":
        print(
            f"tandem: --ingress {ingress} applies to a Ray this command starts; this cluster keeps the "
            "mode its nodes were started with",
            file=sys.stderr,
            flush=True,
        )
    return True


def start_local(
    host: str, port: int, args: AppArgs, metrics_port: int | None, ingress: str, log_level: str
) -> LocalRay:
    """Hold the port, then start a local Ray with enough logical CPUs for `args`' replicas. A taken
    port is refused before the slow imports (Serve, torch) too."""
    holder = port_holder(host, port)
    if holder is not None:
        raise PortTaken(f"cannot serve on {host}:{port}: {holder}. Stop that process or pick another --port.")
    import ray

    from tandem.deploy.app import REPLICA_CPUS

    listener = LoadingListener(host, port)
    # Short: Ray puts the node id (56 characters) under it, and HAProxy's socket paths stop at 97.
    local = LocalRay(tempfile.mkdtemp(prefix="tandem-", dir="/tmp"), listener)
    try:
        scaling = args.autoscaling_config
        replicas = args.num_replicas or (scaling.min_replicas if scaling else 1)
        needed = max(1, replicas) * (args.tp_size * args.cpus_per_rank + REPLICA_CPUS)
        # Logical CPUs, not cores: rank actors mostly wait on the device, and a laptop must fit TP=2 on CPU.
        num_cpus = max(os.cpu_count() or 1, int(needed + 0.999))
        mode, why = resolve_ingress(ingress)
        print(f"tandem: ingress {mode} ({why}; --ingress to choose)", file=sys.stderr, flush=True)
        # Ray's processes inherit this environment: the Serve proxy reads the callback that installs
        # tandem's shaped errors for failed replicas, the controller the ingress mode and its ports,
        # HAProxy its private directory.
        environment = ray_environment(mode, local.state_dir)
        if mode == "haproxy":
            environment.update(haproxy_wrapper_environment(local.state_dir, host))
        for key, value in environment.items():
            os.environ[key] = value
        metrics_port = metrics_port or free_port(host)
        # No dashboard: it accepts job submission, which a model server should not expose, and a Ray built
        # without its web assets waits a minute for it at start. Metrics export does not need it.
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            _metrics_export_port=metrics_port,
            logging_level=logging.getLevelName(log_level),
        )
        drop_worker_log_lines(_ONE_NODE_NOISE)
    except BaseException:
        local.stop()
        raise
    print(
        f"tandem: started a local Ray instance ({num_cpus} CPUs); metrics at "
        f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{metrics_port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return local


def drop_worker_log_lines(marker: str) -> None:
    """Leave out, of the worker log lines Ray prints in this driver, those containing `marker`."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # a private API: if it moves, the line shows, which is harmless
        return
    with dispatcher._lock:
        dispatcher.handlers = [(name, _without(marker, handle)) for name, handle in dispatcher.handlers]


def _without(marker: str, handle: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def filtered(data: dict[str, Any]) -> None:
        lines = [line for line in data.get("lines", ()) if marker not in line]
        if lines:
            handle({**data, "lines": lines})

    return filtered
