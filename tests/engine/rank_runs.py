"""One rank's `RankRuntime` run to completion in a test: its messages delivered at once, then stepped
until it is idle, and the tokens it emitted gathered per request."""

from __future__ import annotations

from tandem.scheduler.messages import SchedulerMsg, TokenOutput
from tandem.scheduler.runtime import RankRuntime


def run_until_idle(
    runtime: RankRuntime, outputs: list[TokenOutput], messages: list[SchedulerMsg]
) -> dict[int, list[int]]:
    """Tokens by request id; `outputs` is the list the runtime emits into."""
    inbox = list(messages)

    def receive(blocking: bool) -> list[SchedulerMsg]:
        msgs = list(inbox)
        inbox.clear()
        return msgs

    runtime.step(receive)
    while runtime.busy:
        runtime.step(receive)
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        if out.token_id is not None:
            tokens.setdefault(out.rid, []).append(out.token_id)
    return tokens
