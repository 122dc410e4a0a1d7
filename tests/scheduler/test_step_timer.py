"""The scheduler's per-phase wall-time totals (what the offline benchmark reports as host vs device)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.scheduler.step_timer import STALL_S, StepTimer


def test_phases_accumulate_and_reset() -> None:
    timer = StepTimer()
    for _ in range(3):
        with timer.phase("a"):
            time.sleep(0.002)
    with pytest.raises(RuntimeError), timer.phase("b"):
        raise RuntimeError("a failing phase still counts")
    summary = timer.summary()
    assert summary["a"]["calls"] == 3 and summary["b"]["calls"] == 1
    assert summary["a"]["total_s"] >= 0.006
    assert summary["a"]["mean_ms"] == pytest.approx(1e3 * summary["a"]["total_s"] / 3, rel=1e-3)
    assert summary["a"]["mean_ms"] <= summary["a"]["max_ms"]
    with timer.phase("a"):  # one stalled call: counted, and it is the longest
        time.sleep(STALL_S)
    after = timer.summary()["a"]
    assert after["stalls"] == summary["a"]["stalls"] + 1 and after["max_ms"] >= 1e3 * STALL_S
    timer.reset()
    assert timer.summary() == {}


@pytest.mark.parametrize("overlap", [True, False])
def test_every_launched_batch_is_timed_through_processing(
    tiny_model_dir: Callable[..., Path], overlap: bool
) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", overlap=overlap)
    try:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        phases = llm.runtime.scheduler.timer.summary()
    finally:
        llm.shutdown()
    assert {"schedule", "launch", "process_results", "wait"} <= set(phases)
    assert phases["launch"]["calls"] >= 6  # one prefill and at least five decode steps
    assert phases["process_results"]["calls"] == phases["launch"]["calls"] == phases["wait"]["calls"]
    assert phases["wait"]["total_s"] <= phases["process_results"]["total_s"]  # wait is nested in it
