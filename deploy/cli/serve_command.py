"""`tandem serve`: resolve the arguments, join or start Ray, deploy, show progress, print the URL, block.

On exit it leaves nothing behind: the Ray it started goes down, and any process of it that outlives
`ray.shutdown()` (an orphaned HAProxy, say) is killed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil
import yaml

from tandem.deploy.app import REPLICA_CPUS
from tandem.deploy.cli.defaults import DEFAULT_APP_NAME, DEFAULT_HOST, DEFAULT_PORT, IMPORT_PATH
from tandem.deploy.cli.processes import ProcessTree, port_holder, stop_processes_naming
from tandem.deploy.config.args import AppArgs
from tandem.deploy.guards.shutdown import (
    DEFAULT_DRAIN_GRACE_S,
    TerminateRequested,
    drain_app,
    raise_terminate,
)
from tandem.deploy.routing.ingress_mode import (
    haproxy_wrapper_environment,
    ray_environment,
    resolve_ingress,
)
from tandem.engine.environment import ray_address, serve_host

DEPLOY_TIMEOUT_S = 3600.0  # large models download and load for a long time; progress shows it is alive


@dataclass(frozen=True)
class ServePlan:
    """What `tandem serve` will deploy, and where."""

    app_args: AppArgs
    name: str
    route_prefix: str
    host: str
    port: int


def plan_from_cli(args: argparse.Namespace) -> ServePlan:
    """Config file values, overridden by the flags that were given."""
    app_args: dict[str, Any] = {}
    http: dict[str, Any] = {}
    name, route_prefix = None, "/"
    if args.config:
        app_args, http, name, route_prefix = _read_config(Path(args.config), args.name)
    overrides = {"model": args.model, "tp_size": args.tp, "device": args.device}
    overrides["served_model_name"] = args.served_model_name
    overrides["api_key"] = getattr(args, "api_key", None)
    overrides["chat_template"] = getattr(args, "chat_template", None)
    overrides["lora_modules"] = getattr(args, "lora_modules", None)
    overrides["lora_dynamic_path"] = getattr(args, "lora_dynamic_path", None)
    overrides["reasoning_parser"] = getattr(args, "reasoning_parser", None)
    app_args.update({k: v for k, v in overrides.items() if v is not None})
    engine = {
        k: getattr(args, k, None)
        for k in (
            "enable_expert_parallel",
            "load_format",
            "enable_lora",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "speculative_config",
        )
    }
    engine = {k: v for k, v in engine.items() if v is not None}
    if engine:  # flags override the config's engine block, field by field
        app_args["engine"] = {**(app_args.get("engine") or {}), **engine}
    return ServePlan(
        app_args=AppArgs.model_validate(app_args),
        name=args.name or name or DEFAULT_APP_NAME,
        route_prefix=route_prefix,
        host=args.host or http.get("host") or serve_host() or DEFAULT_HOST,
        port=args.port or http.get("port") or DEFAULT_PORT,
    )


def _read_config(path: Path, wanted: str | None) -> tuple[dict[str, Any], dict[str, Any], str | None, str]:
    """(app args, http_options, app name, route prefix) from a serve config or a bare args YAML."""
    config = yaml.safe_load(path.read_text()) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"{path}: expected a YAML mapping")
    if "applications" not in config:
        return dict(config), {}, None, "/"
    apps = [a for a in config["applications"] or [] if a.get("import_path") == IMPORT_PATH]
    if wanted is not None:
        apps = [a for a in apps if a.get("name") == wanted]
    if not apps:
        raise SystemExit(
            f"{path}: no application with import_path {IMPORT_PATH}" + (f" named {wanted}" if wanted else "")
        )
    app = apps[0]
    return (
        dict(app.get("args") or {}),
        dict(config.get("http_options") or {}),
        app.get("name"),
        app.get("route_prefix", "/"),
    )


def run_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from tandem.deploy.app import build_app

    plan = plan_from_cli(args)
    log_level = str(getattr(args, "log_level", None) or "warning").upper()
    quiet_driver_logs(log_level)
    processes = ProcessTree()
    started_ray = False
    # Short: Ray puts the node id (56 characters) under it, and HAProxy's socket paths stop at 97.
    state_dir = tempfile.mkdtemp(prefix="tandem-", dir="/tmp")
    try:
        started_ray = _connect_ray(args.address, plan, args.metrics_port, args.ingress, state_dir, log_level)
        # SIGTERM (e.g. from a process manager) stops as cleanly as Ctrl-C, after draining (below). Set
        # after ray.init, which installs a SIGTERM handler of its own in the driver.
        signal.signal(signal.SIGTERM, raise_terminate)
        # A shell starts a background job (`tandem serve &` in a script) with SIGINT ignored, and Python
        # then installs no handler of its own; `kill -INT` should still stop it, as it stops uvicorn.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Serve's controller, proxies and HAProxy log at this level; so do the app's replicas (their
        # access log lines are INFO).
        logging_config = {"log_level": log_level}
        serve.start(http_options={"host": plan.host, "port": plan.port}, logging_config=logging_config)
        serve._run(
            build_app(plan.app_args),
            _blocking=False,
            name=plan.name,
            route_prefix=plan.route_prefix,
            logging_config=logging_config,
        )
        if not wait_until_running(plan.name, plan.app_args.resolved_served_model_name(), sys.stderr):
            return 1
        _print_admission(plan)
        url = _url(plan)
        print(f"tandem: serving '{plan.app_args.resolved_served_model_name()}' at {url}/v1", flush=True)
        print(f"tandem: try  curl {url}/v1/models   (Ctrl-C to stop)", flush=True)
        print(f"tandem: Python handle: {_handle_hint(plan.name)}", flush=True)
        while True:
            processes.snapshot()  # HAProxy reloads start new processes: keep the list current
            time.sleep(5.0)
    except KeyboardInterrupt as interrupt:
        print("tandem: stopping", file=sys.stderr, flush=True)
        if started_ray and isinstance(interrupt, TerminateRequested):
            grace = getattr(args, "drain_timeout", None)
            drain_app(plan.name, DEFAULT_DRAIN_GRACE_S if grace is None else grace)
        return 0
    except PortTaken as taken:
        print(f"tandem: {taken}", file=sys.stderr, flush=True)
        return 1
    finally:
        _stop(plan.name, started_ray)
        if started_ray:
            processes.snapshot()
            ray.shutdown()
            # An HAProxy reload during the shutdown starts processes the snapshot never saw; ours are the
            # ones whose command line names this server's own directory.
            killed = processes.stop_leftovers() + stop_processes_naming(state_dir)
            if killed:
                print(f"tandem: stopped processes Ray left behind: {', '.join(killed)}", file=sys.stderr)


class PortTaken(Exception):
    """The HTTP port cannot be bound: said at once, before Ray starts."""


def _print_admission(plan: ServePlan) -> None:
    """Say how many requests each replica runs at once, and where that figure came from."""
    from ray import serve

    try:
        stats = serve.get_app_handle(plan.name).stats.remote().result(timeout_s=30)
    except Exception as exc:  # informational only
        print(f"tandem: could not read the replicas' admission bounds: {exc}", file=sys.stderr)
        return
    replicas = max(1, int(stats.get("num_replicas", 1)))
    running = int(stats.get("max_ongoing_requests", 0)) // replicas
    queued = int(stats.get("max_queued_requests", 0)) // replicas
    source = "as configured" if plan.app_args.max_ongoing_requests else "the engine's max running requests"
    print(
        f"tandem: max_ongoing_requests {running} per replica ({source}), max_queued_requests "
        f"{'unbounded' if queued < 0 else queued}",
        flush=True,
    )


def quiet_driver_logs(level: str) -> None:
    """Ray's and Serve's loggers in this process at `level` (Ray's INFO lines would bury tandem's own)."""
    for name in ("ray", "ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(level)


def _connect_ray(
    address: str | None,
    plan: ServePlan,
    metrics_port: int,
    ingress: str,
    state_dir: str,
    log_level: str = "WARNING",
) -> bool:
    """Join the given / RAY_ADDRESS / `ray start` cluster, else start a local one. True if started.

    A joined cluster keeps the ingress mode its nodes were started with (see ingress_mode.py)."""
    import ray

    existing = address or ray_address() or _ray_start_address()
    if existing:
        try:
            ray.init(address=existing, logging_level=logging.getLevelName(log_level))
            print(f"tandem: joined the Ray cluster at {existing}", file=sys.stderr, flush=True)
            if ingress != "auto":
                print(
                    f"tandem: --ingress {ingress} applies to a Ray this command starts; this cluster "
                    "keeps the mode its nodes were started with",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        except ConnectionError:
            if address:
                raise
    holder = port_holder(plan.host, plan.port)
    if holder is not None:
        raise PortTaken(
            f"cannot serve on {plan.host}:{plan.port}: {holder}. Stop that process or pick another --port."
        )
    args = plan.app_args
    replicas = args.num_replicas or (args.autoscaling_config.min_replicas if args.autoscaling_config else 1)
    needed = max(1, replicas) * (args.tp_size * args.cpus_per_rank + REPLICA_CPUS)
    # Logical CPUs, not cores: rank actors mostly wait on the device, and a laptop must fit TP=2 on CPU.
    num_cpus = max(os.cpu_count() or 1, int(needed + 0.999))
    mode, why = resolve_ingress(ingress)
    print(f"tandem: ingress {mode} ({why}; --ingress to choose)", file=sys.stderr, flush=True)
    # Ray's processes inherit this environment: the Serve proxy reads the callback that installs tandem's
    # shaped errors for failed replicas, the controller the ingress mode, HAProxy its private directory.
    environment = ray_environment(mode, state_dir)
    if mode == "haproxy":
        environment.update(haproxy_wrapper_environment(state_dir, plan.host))
    for key, value in environment.items():
        os.environ[key] = value
    # No dashboard: it accepts job submission, which a model server should not expose, and a Ray built
    # without its web assets waits a minute for it at start. Metrics export does not need it.
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        logging_level=logging.getLevelName(log_level),
    )
    print(
        f"tandem: started a local Ray instance ({num_cpus} CPUs); metrics at "
        f"http://127.0.0.1:{metrics_port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return True


def _ray_start_address() -> str | None:
    try:
        from ray._private.services import find_bootstrap_address

        found = find_bootstrap_address(None)
        return str(found) if found else None
    except Exception:  # a private API: if it moves, starting a local cluster is the safe fallback
        return None


def command_started_at() -> float:
    """When this process started (wall clock): the figures a user times are from the command's start."""
    try:
        return float(psutil.Process().create_time())
    except psutil.Error:
        return time.time()


def wait_until_running(
    name: str,
    served: str,
    out: TextIO,
    timeout_s: float = DEPLOY_TIMEOUT_S,
    since: float | None = None,
) -> bool:
    """Poll Serve until the app runs, printing its deployments' progress while the model loads. Times
    count from `since` (wall clock; the command's start by default), as the user times them."""
    from ray import serve

    origin = command_started_at() if since is None else since
    start = time.monotonic()
    last_line, last_print = "", 0.0
    interactive = out.isatty()
    while time.monotonic() - start < timeout_s:
        app = serve.status().applications.get(name)
        elapsed = time.time() - origin
        if app is not None and app.status == "RUNNING":
            out.write(
                ("\r" if interactive else "")
                + f"tandem: '{served}' is ready after {elapsed:.0f}s (from the command's start)\n"
            )
            out.flush()
            return True
        if app is not None and app.status == "DEPLOY_FAILED":
            out.write(f"\ntandem: deploying '{name}' failed: {app.message}\n")
            out.flush()
            return False
        line = _progress_line(served, app)
        if interactive:
            out.write(f"\r{line} [{elapsed:.0f}s]\033[K")
            out.flush()
        elif line != last_line or elapsed - last_print >= 10.0:
            out.write(f"{line} [{elapsed:.0f}s]\n")
            out.flush()
            last_line, last_print = line, elapsed
        time.sleep(0.5)
    out.write(f"\ntandem: '{name}' was not running after {timeout_s:.0f}s\n")
    return False


def _progress_line(served: str, app: Any) -> str:
    if app is None:
        return f"tandem: loading '{served}': submitting"
    parts = []
    for dep_name, dep in sorted(app.deployments.items()):
        states = ", ".join(
            f"{n} {str(s).split('.')[-1].lower()}" for s, n in sorted(dep.replica_states.items())
        )
        parts.append(f"{dep_name} {str(dep.status).split('.')[-1].lower()} ({states or 'no replicas yet'})")
    return f"tandem: loading '{served}': " + "; ".join(parts)


def _url(plan: ServePlan) -> str:
    """The URL the proxy really listens on (an already running Serve keeps its own http_options)."""
    host, port = plan.host, plan.port
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        http = (client.get_serve_details().get("http_options") if client is not None else None) or {}
        host, port = http.get("host", host), http.get("port", port)
    except Exception:  # best effort: fall back to what we asked for
        pass
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = plan.route_prefix.rstrip("/")
    return f"http://{shown}:{port}{prefix}"


def _handle_hint(name: str) -> str:
    """How a script on this machine reaches the app's handle (README's example): the Ray address to join."""
    import ray

    env = f"RAY_ADDRESS={ray.get_runtime_context().gcs_address}"
    if os.environ.get("RAY_AUTH_MODE") == "token":  # Ray auto-enables its token only for address="auto"
        env += " RAY_AUTH_MODE=token"
    return (
        f'ray.init(address="auto") then serve.get_app_handle("{name}"); with other Ray instances on this '
        f"machine, set {env}"
    )


def _stop(name: str, started_ray: bool) -> None:
    """Remove the app from a joined cluster. A Ray instance we started goes down with everything in it
    (`ray.shutdown()` in the caller): Ctrl-C in a terminal also reaches Ray's own processes, and talking
    to a GCS that is already gone would hang for a minute."""
    if started_ray:
        return
    from ray import serve

    try:
        serve.delete(name)
    except Exception as exc:  # shutting down anyway; say what was left behind
        print(f"tandem: could not remove application '{name}': {exc}", file=sys.stderr)
