"""tandem's version, as `tandem --version` and `GET /version` report it."""

from __future__ import annotations


def tandem_version() -> str:
    """The installed distribution's version (the source tree's pyproject when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"
