"""One rank of a TP group: embeds an engine and a scheduler and runs the loop in a thread.

Rank 0 receives the replica's messages and forwards each step's batch of them to the other ranks
over the gloo control group, so every rank schedules identically. Only rank 0 sends outputs back.
Wrapped as a Ray actor by `RankGroup`; plain here so it can be read and tested without Ray.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tandem.cluster import rendezvous
from tandem.replicas.channel import ChannelAddress, RankChannel
from tandem.scheduler.messages import SchedulerMsg, TokenOutput
from tandem.scheduler.progress import tqdm_progress
from tandem.scheduler.runtime import RankRuntime, RuntimeLimits, RuntimeOptions

IDLE_POLL_MS = 50  # how long an idle rank 0 waits for messages before beating again


class RankWorker:
    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self.runtime: RankRuntime | None = None
        self.channel: RankChannel | None = None
        self.control: dist.ProcessGroup | None = None
        self.beat = time.monotonic()
        self.busy = False  # requests running or waiting as of the last step (for the watchdog)
        self.error: str | None = None
        self._stop = threading.Event()  # asked to stop (rank 0 relays it to the others)
        self._exit = False  # leave the loop after this step
        self._thread: threading.Thread | None = None
        self._stats: dict[str, Any] = {}
        # Stats are computed by the loop thread, between steps, so they never race the scheduler.
        self._stats_wanted = threading.Event()
        self._stats_ready = threading.Event()
        self._sampled: deque[tuple[int, int]] = deque(maxlen=100_000)

    # ---- set-up, called through Ray ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        return {"node_ip": rendezvous.node_ip(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def pick_port(self) -> tuple[str, int]:
        return rendezvous.node_ip(), rendezvous.free_port()

    def setup(
        self,
        rank: int,
        size: int,
        master: tuple[str, int],
        model_dir: str,
        options: RuntimeOptions,
        channel: ChannelAddress | None,
    ) -> RuntimeLimits:
        self.rank, self.size = rank, size
        use_gpu = options.device.startswith("cuda") or (options.device == "auto" and _has_cuda())
        groups = rendezvous.join(rank, size, master[0], master[1], use_gpu=use_gpu)
        self.control = groups.control
        progress = tqdm_progress(f"rank {rank}: loading weights")
        self.runtime = RankRuntime(Path(model_dir), options, groups.tp, self._emit, progress)
        if rank == 0 and channel is not None:
            self.channel = RankChannel(channel)
        self._thread = threading.Thread(target=self._loop, name=f"tandem-rank{rank}", daemon=True)
        self._thread.start()
        return self.runtime.limits()

    # ---- the loop ----------------------------------------------------------------------------
    def _emit(self, outputs: list[TokenOutput]) -> None:
        self._sampled.extend((o.rid, o.token_id) for o in outputs if o.token_id is not None)
        if self.channel is not None:
            self.channel.send(outputs)

    def _receive(self, blocking: bool) -> list[SchedulerMsg]:
        msgs: list[SchedulerMsg] = []
        if self.rank == 0 and self.channel is not None:
            msgs = self.channel.recv_all(IDLE_POLL_MS if blocking else 0)
        stop = self._stop.is_set()
        if self.size > 1:
            # Every rank takes part in this broadcast once per step, so all see the same messages
            # and leave the loop on the same step.
            box: list[Any] = [msgs, stop]
            dist.broadcast_object_list(box, src=0, group=self.control)
            msgs, stop = box[0], box[1]
        self._exit = stop
        if msgs:
            self.busy = True  # work arrived: a step that hangs from here on is a stuck one
        return msgs

    def _loop(self) -> None:
        assert self.runtime is not None
        try:
            while not self._exit:
                self.beat = time.monotonic()
                self.runtime.step(self._receive)
                self.busy = self.runtime.busy
                if self._stats_wanted.is_set():
                    self._stats_wanted.clear()
                    self._stats = dict(self.runtime.scheduler.stats())
                    self._stats_ready.set()
        except Exception:
            self.error = traceback.format_exc()

    # ---- queries -----------------------------------------------------------------------------
    def heartbeat(self) -> tuple[float, str | None, bool]:
        """Seconds since the loop last beat, the loop's crash report if it died, and whether it has work."""
        return time.monotonic() - self.beat, self.error, self.busy

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self._stats_ready.clear()
        self._stats_wanted.set()
        if not self._stats_ready.wait(timeout_s) and self.error is not None:
            raise RuntimeError(f"rank {self.rank}'s loop crashed: {self.error}")
        return dict(self._stats)

    def describe(self) -> dict[str, Any]:
        """Debug hook: how this rank runs (process-group backend, device, streams)."""
        assert self.runtime is not None
        streams = self.runtime.streams
        return {
            "rank": self.rank,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": str(streams.device),
            "cuda_streams": streams.is_cuda,
            "distinct_streams": len({id(streams.scheduler), id(streams.engine), id(streams.copy)}),
            "overlap": self.runtime.overlap,
        }

    def sampled_tokens(self) -> list[tuple[int, int]]:
        """Debug hook: (request id, token) for every token this rank sampled, in order."""
        return list(self._sampled)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.channel is not None:
            self.channel.close()
        if not (self._thread and self._thread.is_alive()):
            rendezvous.leave()


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
