"""What tandem's own HTTP layer adds to time to first text, without Ray Serve: the LLMServer's FastAPI
app under uvicorn in this process, against `LLMReplica.generate` in the same process, alternating.

It splits the HTTP side into: the client's send to `OpenAIService.completions` (HTTP parsing, routing,
body validation), from there to the request's `LLMReplica.generate` call (the job's checks), from
that call to the first chunk with text (the ranks; compare the in-process figure), and from that chunk
to the client (SSE framing and the socket). The rest of the Serve overhead is Serve's (proxy or HAProxy,
the replica's HTTP server): compare `benchmarks/online_local_overhead.py`.

    python benchmarks/http_overhead.py --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
import torch
import uvicorn

from tandem.benchmarks.common import RESULTS, write_result
from tandem.benchmarks.loadgen import send_request
from tandem.benchmarks.serve_overhead import inprocess_ttft
from tandem.deploy.generation.backend import ReplicaBackend
from tandem.deploy.generation.service import GenerationService
from tandem.deploy.guards.admission import Admission
from tandem.deploy.observability.metrics import NullMetrics
from tandem.deploy.protocol.requests import CompletionRequest
from tandem.deploy.serving.http import build_http_app
from tandem.deploy.serving.openai_service import OpenAIService, Response
from tandem.replicas.chunks import GenerationChunk
from tandem.scheduler.sampling_params import SamplingParams

STAGES = ("client_to_service", "service_to_generate", "generate_to_first_text", "first_text_to_client")


class Marks(dict[str, float]):
    def stamp(self, key: str) -> None:
        self.setdefault(key, time.perf_counter())


class TimedReplica:
    """The LLMReplica, with its generate call and first text chunk stamped."""

    def __init__(self, replica: Any, marks: Marks) -> None:
        self._replica, self._marks = replica, marks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._replica, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[GenerationChunk, None]:
        self._marks.stamp("generate")
        async for chunk in self._replica.generate(*args, **kwargs):
            if chunk.text:
                self._marks.stamp("first_text")
            yield chunk


class TimedService(OpenAIService):
    marks: Marks

    async def completions(self, request: CompletionRequest) -> Response:
        self.marks.stamp("service")
        return await super().completions(request)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from tandem.engine.tiny import default_model_dir
    from tandem.replicas.llm_replica import LLMReplica

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    replica = LLMReplica(str(default_model_dir()), tp_size=1, device=args.device, engine={})
    await replica.start()
    marks = Marks()
    generation = GenerationService(TimedReplica(replica, marks), NullMetrics(), vocab_size=replica.vocab_size)
    service = TimedService(ReplicaBackend(generation, Admission(64, 64)), "tiny")
    service.marks = marks
    server = uvicorn.Server(
        uvicorn.Config(build_http_app(service), host="127.0.0.1", port=0, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    http: list[float] = []
    local: list[float] = []
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    skipped: list[str] = []
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with aiohttp.ClientSession(trust_env=False) as client:
            for i in range(args.requests + 3):  # the first three pairs warm up
                prompt = [(i * 7 + k) % 400 + 5 for k in range(32)]
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                marks.clear()
                reply = await send_request(client, url, {**body, "stream": True}, len(prompt), 60.0)
                other = [(i * 11 + k) % 400 + 5 for k in range(32)]
                ours, _, error = await inprocess_ttft(replica, other, sampling)
                if i < 3:
                    continue
                if not reply.ok or ours is None:
                    # A random-weight model's first tokens may detokenize to no text at all: such a
                    # pair has no time to first text on one side, so it is counted and left out.
                    skipped.append(reply.error or error or "unknown")
                    continue
                http.append(reply.ttft)
                local.append(ours)
                start, first = reply.send_time, reply.send_time + reply.ttft
                points = [start, marks["service"], marks["generate"], marks["first_text"], first]
                for name, a, b in zip(STAGES, points, points[1:], strict=False):
                    stages[name].append(b - a)
    finally:
        server.should_exit = True
        await serving
        await replica.shutdown(drain_timeout_s=2.0)
        ray.shutdown()

    def p50_ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)

    return {
        "requests": len(http),
        "pairs_without_text": len(skipped),
        "http_ttft_ms_p50": p50_ms(http),
        "inprocess_ttft_ms_p50": p50_ms(local),
        "overhead_ms_p50": round(p50_ms(http) - p50_ms(local), 3),
        "stages_ms_p50": {name: p50_ms(values) for name, values in stages.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    config = {"model": "demo model", "prompt_len": 32, "max_tokens": 4, "requests": args.requests}
    path = write_result(
        f"http-overhead-{args.tag}",
        {"config": config, **result},
        device=torch.device(args.device),
        out_dir=args.out_dir,
    )
    print(path)
    print(result)


if __name__ == "__main__":
    main()
