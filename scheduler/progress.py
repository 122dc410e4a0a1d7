"""A tqdm bar for long set-up work (weight loading), as a `(done, total)` callback."""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm


def tqdm_progress(desc: str, *, disable: bool = False) -> Callable[[int, int], None]:
    """Returns a callback that drives one bar; it closes itself when done reaches total."""
    bar: list[tqdm[None]] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=desc, unit="tensor", disable=disable, leave=False))
        bar[0].update(done - bar[0].n)  # update() throttles redraws; refresh() would not
        if done >= total:
            bar[0].close()

    return update
