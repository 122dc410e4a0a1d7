"""What tandem changes in the HAProxy configuration Ray writes, applied by a wrapper around the binary.

Ray's template (ray/serve/_private/haproxy_templates.py) always adds a stats page (`listen stats` on
`*:8404`) and a Prometheus exporter (`frontend prometheus` on `:9101`): fixed ports on every interface,
so a second `tandem serve` on the host cannot start, and both answer other hosts without a key whatever
`--host` says. Neither is used: Ray's own HAProxy metrics come from the admin socket. Ray offers no
setting for their address or for leaving them out, but it runs the binary that
`RAY_SERVE_HAPROXY_BINARY_PATH` names, with the configuration's path as an argument. `tandem serve`
points it at a wrapper (written by ingress_mode.py) that runs this file, which rewrites the configuration
in place and then becomes the real HAProxy (`exec`, same pid, same arguments, as Ray expects):

- `listen stats` and `frontend prometheus` are dropped;
- any other `bind` on every interface is bound to the server's host instead;
- while the app has no route yet (the first moments after start), `/health` answers a 503 saying the
  server is loading, in tandem's error shape, instead of HAProxy's plain-text 404.

Standard library only, run by path (`python -S`), so each HAProxy start or reload pays no imports.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import sys

UNUSED_SECTIONS = ("listen stats", "frontend prometheus")
_ALL_INTERFACES = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|\[::\]|::)?:(\d+)(.*)$")
LOADING_BODY = (
    '{"error": {"message": "loading: the model server is starting (no route yet)", '
    '"type": "server_error", "param": null, "code": "loading"}}'
)
_LOADING_RULE = (
    "    http-request return status 503 content-type application/json "
    f"string '{LOADING_BODY}' hdr retry-after 1 if {{ path_end /health }}"
)


def rewrite(config: str, host: str) -> str:
    """The configuration with the unused listeners dropped and every bind on `host`."""
    out: list[str] = []
    dropping = False
    section = ""
    for line in config.splitlines():
        if line and not line[0].isspace():  # a section header
            section = line.strip()
            dropping = section in UNUSED_SECTIONS
            if dropping:
                continue
        if dropping:
            continue
        match = _ALL_INTERFACES.match(line)
        if match is not None and host not in ("0.0.0.0", "::", "*", ""):
            line = f"{match.group(1)}{_bind_host(host)}:{match.group(2)}{match.group(3)}"
        if section == "backend default_backend" and "http-request return status 404" in line:
            out.append(_LOADING_RULE)
        out.append(line)
    return "\n".join(out) + "\n"


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def config_path(argv: list[str]) -> str | None:
    """The `-f FILE` of HAProxy's command line."""
    for flag, value in itertools.pairwise(argv):
        if flag == "-f":
            return value
    return None


def main(argv: list[str]) -> None:
    """argv: [this file, real haproxy, host, haproxy's own arguments...]."""
    real, host, args = argv[1], argv[2], argv[3:]
    path = config_path(args)
    if path is not None and os.path.exists(path):
        with open(path + ".lock", "w") as lock:  # Ray writes the file under this lock
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(rewrite(text, host))
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
