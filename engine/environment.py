"""The one place tandem reads the process environment; everything else takes arguments.

It sits at the bottom of the layers (`engine`) so that every layer may use it.
- `RAY_ADDRESS`: the Ray cluster to join, as `ray.init` and the `ray` CLI read it.
- `TANDEM_HOST`: the address `tandem serve` binds when no --host is given (the image sets 0.0.0.0).
- `TANDEM_API_KEY`: API keys for `/v1/*`, comma separated (added to the `api_key` app arg).
"""

from __future__ import annotations

import os


def ray_address() -> str | None:
    """The cluster address from RAY_ADDRESS, or None when it is unset or empty."""
    return os.environ.get("RAY_ADDRESS") or None


def api_keys_from_env() -> list[str]:
    """TANDEM_API_KEY: the API keys the server accepts, comma separated (empty entries dropped)."""
    return [key.strip() for key in os.environ.get("TANDEM_API_KEY", "").split(",") if key.strip()]


def serve_host() -> str | None:
    """TANDEM_HOST: where `tandem serve` binds by default (None: unset or empty)."""
    return os.environ.get("TANDEM_HOST") or None
