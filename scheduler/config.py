"""Scheduler settings, resolved (no "auto" values left)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.scheduler.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # requests admitted at once; also the number of token-pool rows
    chunk_size: int  # prefill tokens per step; decode rows come on top
    max_seq_len: int  # context limit: prompt plus output
    prefix_cache: bool = True
    overlap: bool = True
    seed: int = 0  # derives per-request seeds for requests that bring none
    # Debug: check at every allocation that no page in use by an in-flight batch is handed out.
    guard_inflight_pages: bool = False
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off
