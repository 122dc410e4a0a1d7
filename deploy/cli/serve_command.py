"""`tandem serve`: resolve the arguments, join or start Ray, deploy, show progress, print the URL, block.

On exit it leaves nothing behind: the Ray it started goes down with its processes and its state folder
(local_ray.py); an app deployed on a joined cluster is removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil
import yaml

from tandem.deploy.cli.defaults import DEFAULT_APP_NAME, DEFAULT_HOST, DEFAULT_PORT, IMPORT_PATH
from tandem.deploy.cli.engine_flags import engine_overrides
from tandem.deploy.cli.local_ray import LocalRay, PortTaken, join_existing, start_local
from tandem.deploy.cli.serve_flags import app_overrides
from tandem.deploy.config.args import AppArgs
from tandem.deploy.guards.shutdown import (
    DEFAULT_DRAIN_GRACE_S,
    TerminateRequested,
    drain_app,
    raise_terminate,
)
from tandem.engine.environment import serve_host
from tandem.engine.options import EngineOptions, from_vllm
from tandem.scheduler.options import RuntimeOptions

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
    app_args.update(app_overrides(args))
    engine = engine_overrides(args)
    if engine:  # flags override the config's engine block, field by field
        block = app_args.pop("engine", None) or app_args.pop("engine_kwargs", None) or {}
        # The config's block may use vLLM's names; the flags give tandem's, which then win.
        app_args["engine"] = {**from_vllm(dict(block), RuntimeOptions, EngineOptions), **engine}
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
    plan = plan_from_cli(args)
    log_level = str(getattr(args, "log_level", None) or "warning").upper()
    quiet_driver_logs(log_level)
    local: LocalRay | None = None
    joined = False
    try:
        joined = join_existing(args.address, args.ingress, log_level)
        if not joined:
            local = start_local(
                plan.host, plan.port, plan.app_args, args.metrics_port, args.ingress, log_level
            )
        from ray import serve  # the slow imports, after a taken port was refused

        from tandem.deploy.app import build_app

        # SIGTERM (e.g. from a process manager) stops as cleanly as Ctrl-C, after draining (below). Set
        # after ray.init, which installs a SIGTERM handler of its own in the driver.
        signal.signal(signal.SIGTERM, raise_terminate)
        # A shell starts a background job (`tandem serve &` in a script) with SIGINT ignored, and Python
        # then installs no handler of its own; `kill -INT` should still stop it, as it stops uvicorn.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Serve's controller, proxies and HAProxy log at this level; so do the app's replicas (their
        # access log lines are INFO).
        logging_config = {
            "log_level": log_level,
            "enable_access_log": not getattr(args, "disable_log_requests", False),
        }
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
        if local is not None:
            local.listener.close()  # Serve's own listener answers from here on
        _print_admission(plan)
        url = _url(plan)
        print(f"tandem: serving '{plan.app_args.resolved_served_model_name()}' at {url}/v1", flush=True)
        print(f"tandem: try  curl {url}/v1/models   (Ctrl-C to stop)", flush=True)
        print(f"tandem: Python handle: {_handle_hint(plan.name)}", flush=True)
        while True:
            if local is not None:
                local.processes.snapshot()  # HAProxy reloads start new processes: keep the list current
            time.sleep(5.0)
    except KeyboardInterrupt as interrupt:
        print("tandem: stopping", file=sys.stderr, flush=True)
        if local is not None and isinstance(interrupt, TerminateRequested):
            grace = getattr(args, "drain_timeout", None)
            drain_app(plan.name, DEFAULT_DRAIN_GRACE_S if grace is None else grace)
        return 0
    except PortTaken as taken:
        print(f"tandem: {taken}", file=sys.stderr, flush=True)
        return 1
    finally:
        if joined:
            _remove_app(plan.name)
        if local is not None:
            killed = local.stop()
            if killed:
                print(f"tandem: stopped processes Ray left behind: {', '.join(killed)}", file=sys.stderr)


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


def _remove_app(name: str) -> None:
    """Remove the app from a cluster this command joined (a Ray it started goes down with everything
    in it)."""
    from ray import serve

    try:
        serve.delete(name)
    except Exception as exc:  # shutting down anyway; say what was left behind
        print(f"tandem: could not remove application '{name}': {exc}", file=sys.stderr)
