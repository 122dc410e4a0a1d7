"""Weight loading reports real progress where its output is a log (a Ray actor's stderr), not only the
bar's first state."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem import LLM
from tandem.scheduler.progress import tqdm_progress


def test_loading_weights_reports_each_quarter_up_to_all_tensors(
    tiny_model_dir: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu")
    llm.shutdown()
    err = capsys.readouterr().err
    found = re.findall(r"loading weights: (\d+)% \((\d+)/(\d+) tensors", err)
    percents = [int(p) for p, _, _ in found]
    assert len(percents) == 4 and percents[-1] == 100, err[-2000:]
    assert all(25 * q <= p < 25 * (q + 1) for q, p in enumerate(percents[:-1], start=1)), percents
    done, total = int(found[-1][1]), int(found[-1][2])
    assert done == total > 4  # every tensor of the model, counted as loaded


def test_a_terminal_gets_a_bar_and_a_disabled_report_writes_nothing() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    report = tqdm_progress("loading weights", out=terminal)
    for done in range(1, 11):
        report(done, 10)
    assert "10/10" in terminal.getvalue()  # the bar is left at its end, not erased at 0%
    quiet = io.StringIO()
    silent = tqdm_progress("loading weights", out=quiet, disable=True)
    silent(10, 10)
    assert quiet.getvalue() == ""
