"""`tandem.LLM(tp_size > 1)`: an LLMReplica on a local Ray cluster, driven from synchronous code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tqdm import tqdm

from tandem.cluster.ray_cluster import ensure_ray
from tandem.replicas.llm_replica import LLMReplica
from tandem.replicas.request_output import RequestOutput
from tandem.scheduler.messages import LoRARequest
from tandem.scheduler.runtime import RuntimeLimits, RuntimeOptions
from tandem.scheduler.sampling_params import SamplingParams

T = TypeVar("T")


class RemoteGroup:
    """Runs the replica's asyncio side in a private event-loop thread owned by this object."""

    def __init__(self, model_dir: str, tp_size: int, options: RuntimeOptions) -> None:
        ensure_ray()
        engine = {k: v for k, v in options.flat().items() if k != "device"}
        self.replica = LLMReplica(model_dir, tp_size=tp_size, device=options.device, engine=engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-llm-loop", daemon=True)
        self._thread.start()
        self._run(self.replica.start())
        assert self.replica.limits is not None
        self.limits: RuntimeLimits = self.replica.limits

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")

        async def served(lora: LoRARequest | None) -> LoRARequest | None:
            # The replica names its adapters; the caller's id keeps two adapters of one name apart.
            if lora is None:
                return None
            return await self.replica.add_lora(f"{lora.lora_name}#{lora.lora_int_id}", lora.lora_path)

        async def one(prompt: list[int], p: SamplingParams, lora: LoRARequest | None) -> RequestOutput:
            out = RequestOutput(prompt_token_ids=prompt)
            async for chunk in self.replica.generate(prompt, p, lora=await served(lora)):
                out.token_ids.extend(chunk.token_ids)
                out.text += chunk.text
                out.logprobs.extend(chunk.logprobs or [])
                out.top_logprobs.extend(chunk.top_logprobs or [])
                out.add_prompt_logprobs(chunk.prompt_logprobs, chunk.prompt_top_logprobs)
                if chunk.finish_reason is not None:
                    if chunk.finish_reason == "error":
                        raise RuntimeError(f"generation failed: {chunk.error}")
                    out.finish_reason = chunk.finish_reason
            bar.update(1)
            return out

        async def all_of() -> list[RequestOutput]:
            chosen = loras or [None] * len(ids)
            return list(await asyncio.gather(*(one(i, p, a) for i, p, a in zip(ids, params, chosen))))

        try:
            return self._run(all_of())
        finally:
            bar.close()

    def stats(self) -> dict[str, Any]:
        return self._run(self.replica.stats())

    def shutdown(self) -> None:
        self._run(self.replica.shutdown(drain_timeout_s=5.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
