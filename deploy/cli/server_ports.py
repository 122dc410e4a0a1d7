"""The listener that answers on `tandem serve`'s HTTP port while the server starts.

`LoadingListener` binds the HTTP port first thing, with SO_REUSEPORT as Serve's proxy and (configured so,
see ingress_mode.py) HAProxy bind it too: from the moment the port is open it answers 503 `loading`, and
once Serve's listener is up beside it and the app runs, it closes and leaves the port to them.

It runs as a child process (this file, by path, `python -S`, standard library only), not as a thread of
the command: the command imports torch and starts Ray meanwhile, and loading an extension holds the GIL
for seconds, which a probe would see as a hang. The child exits when its stdin closes, so it dies with
the command however the command ends.

The other ports tandem picks for a server are free ones, never fixed (ingress_mode.py and local_ray.py).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

READY = "ready"
START_TIMEOUT_S = 30.0


class LoadingListener:
    """503 `loading` on `host:port`, from a child process, until `close()`."""

    def __init__(self, host: str, port: int) -> None:
        from tandem.deploy.routing.haproxy_filter import LOADING_BODY

        command = [sys.executable, "-S", __file__, host, str(port), LOADING_BODY]
        self._child: subprocess.Popen[str] | None = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._child.stdout is not None
        ready, _, _ = select.select([self._child.stdout], [], [], START_TIMEOUT_S)
        line = self._child.stdout.readline().strip() if ready else ""
        if line != READY:
            self.close()
            raise OSError(f"could not answer on {host}:{port} while loading: {line or 'no answer'}")

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.terminate()
        try:
            child.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=5.0)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


# ---- the child ----------------------------------------------------------------------------------------


class _LoadingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, body: bytes) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.body = body
        super().__init__((host, port), _LoadingHandler)

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class _LoadingHandler(BaseHTTPRequestHandler):
    server: _LoadingServer

    def _loading(self) -> None:
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("retry-after", "1")
        self.send_header("content-length", str(len(self.server.body)))
        self.send_header("connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.server.body)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _loading

    def log_message(self, format: str, *args: object) -> None:
        pass  # the server log is not the place for every probe while loading


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main(argv: list[str]) -> None:
    """argv: [this file, host, port, body]."""
    try:
        server = _LoadingServer(argv[1], int(argv[2]), argv[3].encode())
    except OSError as exc:
        print(exc, flush=True)
        sys.exit(1)
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    print(READY, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
