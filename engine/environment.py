"""The one place tandem reads the process environment; everything else takes arguments.

It sits at the bottom of the layers (`engine`) so that every layer may use it.
- `RAY_ADDRESS`: the Ray cluster to join, as `ray.init` and the `ray` CLI read it.
"""

from __future__ import annotations

import os


def ray_address() -> str | None:
    """The cluster address from RAY_ADDRESS, or None when it is unset or empty."""
    return os.environ.get("RAY_ADDRESS") or None
