"""Progress of long set-up work (weight loading), as a `(done, total)` callback.

On a terminal it drives a tqdm bar. Elsewhere (a Ray actor's stderr is a log file that Ray streams to the
driver line by line) a bar's carriage-return redraws never reach a reader: only its first state, 0%, did,
since a small model loads within tqdm's redraw interval and a bar that is not left erases itself. There it
writes a plain line at each quarter instead, and one at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

LINE_STEPS = 4  # lines per load when not on a terminal: 25%, 50%, 75%, 100%


def tqdm_progress(
    desc: str, *, disable: bool = False, out: TextIO | None = None
) -> Callable[[int, int], None]:
    """Returns a callback that reports one load; it closes itself when done reaches total."""
    stream = sys.stderr if out is None else out
    if disable:
        return lambda done, total: None
    if stream.isatty():
        return _bar(desc, stream)
    return _lines(desc, stream)


def _bar(desc: str, stream: TextIO) -> Callable[[int, int], None]:
    bar: list[tqdm[None]] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=desc, unit="tensor", file=stream))
        if bar[0].disable:  # closed
            return
        bar[0].update(done - bar[0].n)  # update() throttles redraws; refresh() would not
        if done >= total:
            bar[0].close()

    return update


def _lines(desc: str, stream: TextIO) -> Callable[[int, int], None]:
    started = time.monotonic()
    shown = [0]  # the last step written

    def update(done: int, total: int) -> None:
        step = LINE_STEPS if done >= total else done * LINE_STEPS // max(1, total)
        if step <= shown[0]:
            return
        shown[0] = step
        percent = 100 * min(done, total) // max(1, total)
        seconds = time.monotonic() - started
        stream.write(f"{desc}: {percent}% ({done}/{total} tensors, {seconds:.1f}s)\n")
        stream.flush()

    return update
