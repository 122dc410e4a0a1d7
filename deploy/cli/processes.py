"""What `tandem serve` owns on its host: its port, and the processes of a Ray it started.

A Ray instance started by `tandem serve` runs GCS, raylet, workers and, with the HAProxy ingress, an
HAProxy that Serve's proxy actor spawns. `ray.shutdown()` stops Ray's own processes, but an HAProxy
whose parent was killed is orphaned and keeps the port: a later server on the same port is then never
reached, and the stale HAProxy answers every request itself from its error page. So the processes are
listed before shutdown and whatever outlives it is killed.
"""

from __future__ import annotations

import contextlib
import socket
import time

import psutil


def port_holder(host: str, port: int) -> str | None:
    """None if `host:port` can be bound now; else who holds it, as well as the host lets us tell."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As a server binds (SO_REUSEADDR ignores sockets in TIME_WAIT, not listeners).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError as exc:
            reason = exc.strerror or str(exc)
    for owner in _listeners(port):
        return f"{reason}: pid {owner.pid} ({_describe(owner)})"
    return reason


def _listeners(port: int) -> list[psutil.Process]:
    owners: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                with contextlib.suppress(psutil.Error):
                    owners.append(psutil.Process(conn.pid))
    return owners


def _describe(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline()[:3]) or process.name()
    return "unknown"


class ProcessTree:
    """The processes this one started, directly or not, as of `snapshot()`."""

    def __init__(self) -> None:
        self._seen: dict[int, psutil.Process] = {}

    def snapshot(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                self._seen[child.pid] = child

    def stop_leftovers(self, grace_s: float = 5.0) -> list[str]:
        """Wait up to `grace_s` for the snapshot's processes to exit, then kill the rest; describe
        what had to be killed."""
        alive = [p for p in self._seen.values() if _running(p)]
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
        killed = []
        for process in alive:
            with contextlib.suppress(psutil.Error):
                killed.append(f"pid {process.pid} ({_describe(process)})")
                process.kill()
        psutil.wait_procs(alive, timeout=2.0)
        return killed


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    return False


def stop_processes_naming(marker: str, settle_s: float = 3.0) -> list[str]:
    """Kill every process whose command line mentions `marker` (a directory only this server uses),
    until none has shown up for a second or `settle_s` has passed; describe what was killed."""
    killed: list[str] = []
    deadline = time.monotonic() + settle_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in part for part in process.info["cmdline"] or ()):
                    found.append(process)
        for process in found:
            with contextlib.suppress(psutil.Error):
                killed.append(f"pid {process.pid} ({_describe(process)})")
                process.kill()
        if found:
            psutil.wait_procs(found, timeout=1.0)
            quiet_since = time.monotonic()
        time.sleep(0.1)
    return killed
