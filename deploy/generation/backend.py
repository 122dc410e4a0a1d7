"""The `Backend` of an LLMServer replica: its own `GenerationService`, behind in-app admission.

Requests run in this process (no Serve hop between the HTTP route and the model). Stats and health
cover every replica of the deployment: they are broadcast through a handle to the replica's own
deployment, which Serve resolves when first needed (so the backend also works outside Serve, in tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError

from tandem.deploy.generation.job_run import JobRun
from tandem.deploy.generation.service import GenerationService
from tandem.deploy.guards.admission import Admission
from tandem.deploy.protocol.jobs import GenerateJob, JobRejected

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0  # stats and health calls; a replica slower than this counts as unhealthy


class ReplicaBackend:
    def __init__(
        self,
        service: GenerationService,
        admission: Admission,
        deployment_handle: Callable[[], Any] | None = None,
    ) -> None:
        self._service = service
        self.generation = service  # the tokenizer routes use its tokenization directly
        self._admission = admission
        self._deployment_handle = deployment_handle
        self._handle: Any = None

    async def start(self, job: GenerateJob) -> JobRun | JobRejected:
        # The slot is held until the job's last token arrives from the engine, or the run is closed
        # first (the client went away), whichever comes first.
        release = await self._admission.acquire(job.num_choices)
        try:
            result = await self._service.start(job, on_engine_done=release)
        except BaseException:
            release()
            raise
        if isinstance(result, JobRejected):
            release()
        return result

    async def replica_stats(self) -> list[dict[str, Any]]:
        try:
            results = await self._broadcast("replica_stats")
        except (DeploymentUnavailableError, TimeoutError):
            return []  # no replica answering (all dead or being replaced): nothing to sum
        return [r for r in results if isinstance(r, dict)]

    async def replica_health(self) -> list[str | None]:
        """A short reason code per unhealthy replica (None: healthy); the details go to the log."""
        try:
            results = await self._broadcast("check_health")
        except TimeoutError:
            logger.warning("a replica did not answer its health check within %ss", CONTROL_TIMEOUT_S)
            return ["health_check_timeout"]
        except DeploymentUnavailableError as exc:
            logger.warning("no model server is available: %s", exc)
            return ["no_replica"]
        return [None if not isinstance(r, BaseException) else _reason(r) for r in results]

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        if self._handle is None and self._deployment_handle is not None:
            self._handle = self._deployment_handle()
        if self._handle is None:
            return []  # outside Serve: no deployment to ask
        broadcast = self._handle.broadcast(method, *args)
        return list(await broadcast.results_async(timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True))

    async def announce(self, method: str, args: tuple[Any, ...]) -> None:
        """Call `method(*args)` on every running replica of the deployment (this one included), as a
        control message: a replica that fails or is gone is logged and skipped."""
        try:
            results = await self._broadcast(method, *args)
        except (DeploymentUnavailableError, TimeoutError) as exc:
            logger.warning("could not tell the replicas %s: %s", method, exc)
            return
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a replica failed %s: %s", method, result)

    async def gather(self, method: str) -> list[Any]:
        """`method()`'s answers from every running replica that gives one (none: an empty list)."""
        try:
            results = await self._broadcast(method)
        except (DeploymentUnavailableError, TimeoutError):
            return []
        return [r for r in results if not isinstance(r, BaseException)]


def _reason(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    logger.warning("a replica is unhealthy: %s: %s", type(cause).__name__, cause)
    code = getattr(cause, "code", None)
    return code if isinstance(code, str) else "replica_unhealthy"
