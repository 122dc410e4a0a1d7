"""Judges a replica's ranks from their heartbeats, and names what is wrong with a short reason code.

A rank beats at the start of every loop step; an idle rank 0 still steps every poll interval, and the
other ranks step with it. So a rank that has work (requests running or waiting) and has not beaten
for `stuck_after_s` is stuck: in a kernel that never returns, in a collective whose peer stopped, or
paused. Without work a beat may be older (a rank waiting for its peers' next step), and only a much
older one (`idle_after_s`) counts. A rank that does not answer its heartbeat call at all is
unreachable (dead, or its process stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_BEAT_AGE_S = 60.0


@dataclass(frozen=True)
class Beat:
    """What a rank's `heartbeat()` reports."""

    age_s: float  # since the loop last began a step
    error: str | None  # the loop's crash report, if it died
    busy: bool  # it had requests running or waiting at its last step


@dataclass(frozen=True)
class Problem:
    code: str  # short, for /health: rank_unreachable | rank_crashed | rank_stuck | receive_loop_died ...
    detail: str  # for the log


class ReplicaUnhealthy(RuntimeError):
    """`check_health`'s failure; `code` is what /health shows, the message what the log shows."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(p.detail for p in problems))
        self.code = problems[0].code if problems else "replica_unhealthy"
        self.problems = problems

    def __reduce__(self) -> tuple[object, ...]:  # Ray pickles it back to the caller of check_health
        return (ReplicaUnhealthy, (self.problems,))


class RankWatchdog:
    def __init__(self, stuck_after_s: float, idle_after_s: float = IDLE_BEAT_AGE_S) -> None:
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = stuck_after_s
        self.idle_after_s = max(idle_after_s, stuck_after_s)

    def judge(self, rank: int, beat: Beat | BaseException) -> Problem | None:
        if isinstance(beat, BaseException):
            return Problem("rank_unreachable", f"rank {rank} is unreachable: {type(beat).__name__}")
        if beat.error is not None:
            last = beat.error.strip().splitlines()[-1] if beat.error.strip() else "unknown error"
            return Problem("rank_crashed", f"rank {rank}'s loop crashed: {last}")
        if beat.busy and beat.age_s > self.stuck_after_s:
            return Problem(
                "rank_stuck",
                f"rank {rank} has work but has not stepped for {beat.age_s:.1f}s "
                f"(stuck_rank_timeout_s={self.stuck_after_s:g})",
            )
        if beat.age_s > self.idle_after_s:
            return Problem("rank_stuck", f"rank {rank}'s heartbeat is {beat.age_s:.1f}s old")
        return None


def task_died(name: str, exc: BaseException) -> Problem:
    """The problem of a replica background task (the receive loop) that ended with an exception."""
    return Problem(
        f"{name}_died", f"the replica's {name.replace('_', ' ')} died: {type(exc).__name__}: {exc}"
    )


def codes_of(problems: list[Problem]) -> str:
    return ", ".join(sorted({p.code for p in problems})) or "replica_unhealthy"


def client_reason(problems: list[Problem], request_id: str) -> str:
    """What a client whose request a failure ended is told: the reason codes and its request id. The
    details (a rank's last traceback line names internal addresses, ports and source paths) go to the
    server log beside that id, not to the client."""
    return (
        f"the model server's replica failed ({codes_of(problems)}); the server log has the details "
        f"under request id {request_id}"
    )
