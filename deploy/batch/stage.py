"""What the engine stages share: the actor's engine, and the check that tells a request's failure from the
engine's."""

from __future__ import annotations

import logging

from tandem.deploy.batch.host import EngineFailure, EngineHost, EngineSpec

logger = logging.getLogger(__name__)


class EngineStage:
    """Base of the Ray Data callable classes that run one engine per actor."""

    def __init__(self, spec: EngineSpec, host: EngineHost | None = None) -> None:
        self._host = host if host is not None else EngineHost(spec)  # a given host: tests, in process

    async def ensure_healthy(self, failure: str) -> None:
        """Raise EngineFailure if a request failed because the engine did (a rank gone); return if the
        engine is fine, so that the failure is the request's own."""
        try:
            await self._host.replica.check_health()
        except Exception as exc:
            raise EngineFailure(f"{failure}; the engine is unhealthy: {exc}") from None

    def __del__(self) -> None:
        # Ray Data drops its actors gracefully once a dataset is done (a killed or crashed actor skips
        # this): stop the ranks and give back their placement group.
        host = getattr(self, "_host", None)
        if host is not None:
            host.close()
