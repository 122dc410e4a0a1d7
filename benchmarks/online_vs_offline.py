"""`tandem bench online --vs-offline`: the same workload in process and over HTTP, in one run.

For each model: the in-process `LLM` runs nano-vllm's workload (256 requests, prompt and output lengths
U(100, 1024), `random.seed(0)`, T=0.6, `ignore_eos`), then `tandem serve --model M` starts with its
defaults and the same requests go over HTTP as concurrent streaming `/v1/completions`, then a few
requests one at a time (concurrency 1). Each side runs in its own process, so neither holds GPU memory
while the other runs. Reported: output tok/s of both sides and their ratio, TTFT / ITL / TPOT / E2E
percentiles, tokens per SSE event, and what the server chose (ingress, max_ongoing_requests).

The main model's vocabulary equals its tokenizer's (512 ids), so every sampled token is text and
streaming figures count real events. The wide-vocab model (151,936-id LM head over the same tokenizer)
is the detokenizer's stress case: almost every sampled id is one the tokenizer does not know.

    python benchmarks/online_vs_offline.py --out benchmarks/results/online-vs-offline-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tandem.benchmarks.loadgen import RequestResult, send_request, summarize

SHAPE = "qwen3-0.6b"
TOKENIZER_VOCAB = 512  # the tiny tokenizer's ids, specials included
WIDE_VOCAB = 151_936
SERVE_START_TIMEOUT_S = 900.0


def workload(num_seqs: int, vocab: int, max_len: int = 1024, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's draws (lengths and order as benchmarks/offline.py), ids folded into the vocabulary."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 10000) % vocab for _ in range(rng.randint(100, max_len))] for _ in range(num_seqs)
    ]
    outputs = [rng.randint(100, max_len) for _ in range(num_seqs)]
    return list(zip(prompts, outputs))


# ---- the offline side (a child process) ----------------------------------------------------------
def offline_side(model_dir: str, num_seqs: int, vocab: int, max_len: int) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    requests = workload(num_seqs, vocab, max_len)
    llm = LLM(model_dir)
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True) for _, n in requests]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    # The engine's batch-1 decode step: one request's long and short runs, difference over the extra tokens.
    step, phases = [], {}
    for n in (32, 32 + max_len):
        llm.runtime.scheduler.timer.reset()
        t = time.perf_counter()
        llm.generate(
            [requests[0][0]], SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True), use_tqdm=False
        )
        step.append(time.perf_counter() - t)
        phases = llm.runtime.scheduler.timer.summary()
    llm.shutdown()
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "tok_s": round(tokens / elapsed, 1),
        "b1_decode_ms": round((step[1] - step[0]) / max_len * 1e3, 4),
        "b1_step_phases": phases,  # the long run's loop phases (scheduler/step_timer.py)
    }


def actor_side(model_dir: str, vocab: int, max_len: int, device: str) -> dict[str, Any]:
    """The same batch-1 decode step with the rank in a Ray actor, as `tandem serve` runs it, driven
    through `LLMReplica` in this process (no Serve, no HTTP): what the actor itself adds to a step."""
    import ray

    from tandem import SamplingParams
    from tandem.replicas.llm_replica import LLMReplica

    prompt = workload(1, vocab, max_len)[0][0]

    async def run() -> dict[str, Any]:
        replica = LLMReplica(model_dir, device=device)
        await replica.start()
        try:
            step, phases = [], {}
            for n in (8, 32, 32 + max_len):  # the first is a warm-up
                before = await replica.stats()
                t = time.perf_counter()
                async for _ in replica.generate(
                    prompt, SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True)
                ):
                    pass
                step.append(time.perf_counter() - t)
                phases = _phase_delta(
                    before.get("step_phases", {}), (await replica.stats()).get("step_phases", {})
                )
        finally:
            await replica.shutdown(drain_timeout_s=5)
        return {"b1_decode_ms": round((step[2] - step[1]) / max_len * 1e3, 4), "b1_step_phases": phases}

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        return asyncio.run(run())
    finally:
        ray.shutdown()


def _phase_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per phase, the calls and mean ms between two `step_phases` snapshots of one loop."""
    out = {}
    for name, end in after.items():
        start = before.get(name, {"total_s": 0.0, "calls": 0})
        calls = end["calls"] - start["calls"]
        if calls > 0:
            out[name] = {
                "calls": calls,
                "mean_ms": round(1e3 * (end["total_s"] - start["total_s"]) / calls, 4),
            }
    return out


def run_side(function: str, *args: Any) -> dict[str, Any]:
    """`function(*args)` of this module in a fresh process, so no side holds GPU memory after it."""
    call = f"{function}({', '.join(repr(a) for a in args)})"
    code = (
        "import json; from tandem.benchmarks import online_vs_offline as m; "
        f"print('RESULT ' + json.dumps(m.{call}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"{function} failed:\n{proc.stderr[-4000:]}")


# ---- the online side -------------------------------------------------------------------------------
class Server:
    """`tandem serve --model M` with its defaults, as a user starts it; stopped with Ctrl-C."""

    def __init__(self, model_dir: Path, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        command = [sys.executable, "-m", "tandem.deploy.cli.main", "serve", "--model", str(model_dir)]
        command += ["--port", str(port), "--metrics-port", str(_free_port())]
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            print(f"  [serve] {line.rstrip()}", flush=True)
            if "tandem: serving" in line:
                self._ready.set()

    def wait_ready(self) -> None:
        if not self._ready.wait(SERVE_START_TIMEOUT_S):
            raise RuntimeError("tandem serve did not start:\n" + "\n".join(self.lines[-40:]))

    def found(self, pattern: str) -> str | None:
        for line in self.lines:
            match = re.search(pattern, line)
            if match:
                return match.group(1)
        return None

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=30)


async def _send_all(
    url: str, model: str, requests: list[tuple[list[int], int]], concurrency: int, allow_empty: bool
) -> Any:
    import aiohttp

    route = url + "/v1/completions"
    pending = iter(requests)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    results: list[RequestResult] = []
    events = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal events
        for prompt, max_tokens in pending:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.6,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            result = await send_request(session, route, body, len(prompt), 600.0, allow_empty=allow_empty)
            results.append(result)
            events += len(result.chunk_times)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(min(concurrency, len(requests)))))
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["content_events"] = events
    summary["tokens_per_event"] = round(summary["total_output_tokens"] / max(events, 1), 3)
    return summary


def run_online(model_dir: Path, num_seqs: int, vocab: int, max_len: int, solo: int) -> dict[str, Any]:
    requests = workload(num_seqs, vocab, max_len)
    # With a vocabulary wider than the tokenizer, a whole stream may be ids that are no text.
    empty_ok = vocab > TOKENIZER_VOCAB
    server = Server(model_dir, _free_port())
    try:
        server.wait_ready()
        model = str(model_dir)
        asyncio.run(
            _send_all(server.url, model, requests[:4], 4, empty_ok)
        )  # warm-up: connections, first steps
        loaded = asyncio.run(_send_all(server.url, model, requests, len(requests), empty_ok))
        solo_requests = [(p, min(256, max_len)) for p, _ in requests[:solo]]
        single = asyncio.run(_send_all(server.url, model, solo_requests, 1, empty_ok))
    finally:
        code = server.stop()
    return {
        "concurrent": loaded,
        "concurrency_1": single,
        "ingress": server.found(r"tandem: ingress (\w+)"),
        "max_ongoing_requests": _int(server.found(r"max_ongoing_requests (\d+) per replica")),
        "exit_code": code,
    }


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pcts(stats: dict[str, Any]) -> dict[str, Any]:
    return {"p50": stats["p50"], "p99": stats["p99"]}


def main(argv: list[str] | None = None) -> int:
    import torch

    from tandem.benchmarks.common import device_info, git_commit
    from tandem.benchmarks.shapes import SHAPES, write_random_model

    p = argparse.ArgumentParser(prog="tandem bench online --vs-offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--shape", choices=[SHAPE, "tiny"], default=SHAPE, help="tiny: a CPU smoke run.")
    p.add_argument("--max-len", type=int, default=1024, help="Prompt and output lengths are U(100, N).")
    p.add_argument("--solo-requests", type=int, default=4, help="Requests of the concurrency-1 point.")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-bench-models"))
    p.add_argument("--no-wide-vocab", action="store_true", help="Skip the wide-vocab stress case.")
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "online-vs-offline.json"
    )
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family, shape = SHAPES[args.shape] if args.shape != "tiny" else ("qwen3", {})
    cases = {"main": TOKENIZER_VOCAB}
    if not args.no_wide_vocab:
        cases["wide"] = WIDE_VOCAB
    sides: dict[str, dict[str, Any]] = {}
    for name, vocab in cases.items():
        model_dir = write_random_model(
            args.models_dir / f"{args.shape}-vocab{vocab}",
            family,
            device=device,
            **{**shape, "vocab_size": vocab},
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the weights were drawn on the GPU; the servers need it whole
        print(f"== {name}: offline, vocab {vocab}", flush=True)
        offline = run_side("offline_side", str(model_dir), args.num_seqs, vocab, args.max_len)
        if name == "main":
            print(f"== {name}: batch-1 step with the rank in a Ray actor", flush=True)
            offline["actor"] = run_side("actor_side", str(model_dir), vocab, args.max_len, device.type)
        print(f"== {name}: online, vocab {vocab}", flush=True)
        online = run_online(model_dir, args.num_seqs, vocab, args.max_len, args.solo_requests)
        sides[name] = {"vocab": vocab, "offline": offline, "online": online}
        # Each case is kept as soon as it is measured: a later case that runs out of time loses only itself.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(f".{name}.json").write_text(json.dumps(sides[name], indent=2) + "\n")
        loaded = online["concurrent"]
        print(
            f"== {name}: offline {offline['tok_s']} tok/s, online {loaded['output_throughput']} tok/s, "
            f"ratio {loaded['output_throughput'] / offline['tok_s']:.3f}, TTFT p50/p99 "
            f"{loaded['ttft_ms']['p50']}/{loaded['ttft_ms']['p99']} ms, "
            f"{loaded['tokens_per_event']} tok/event, failed {loaded['failed']}",
            flush=True,
        )

    main_case = sides["main"]
    offline_tok_s = main_case["offline"]["tok_s"]
    loaded = main_case["online"]["concurrent"]
    online_tok_s = loaded["output_throughput"]
    wide = sides.get("wide")
    result = {
        "benchmark": "online_vs_offline",
        "device": device_info(device),
        "commit": git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": f"{args.shape} shape, random bf16 weights, vocab {TOKENIZER_VOCAB} = its tokenizer's",
        "workload": f"{args.num_seqs} requests, prompts and outputs U(100, {args.max_len}), seed 0, T=0.6, "
        "ignore_eos; all concurrent, streaming /v1/completions; then concurrency 1 (256 tokens each)",
        "offline_tok_s": offline_tok_s,
        "online_tok_s": online_tok_s,
        "ratio": round(online_tok_s / offline_tok_s, 4),
        "wide_vocab_ratio": (
            round(wide["online"]["concurrent"]["output_throughput"] / wide["offline"]["tok_s"], 4)
            if wide
            else None
        ),
        "ttft_ms": _pcts(loaded["ttft_ms"]),
        "itl_ms": _pcts(loaded["itl_ms"]),
        "tpot_ms": _pcts(loaded["tpot_ms"]),
        "e2e_ms": _pcts(loaded["e2e_ms"]),
        "tokens_per_event": loaded["tokens_per_event"],
        "concurrency_1": {
            "itl_ms": _pcts(main_case["online"]["concurrency_1"]["itl_ms"]),
            "tokens_per_event": main_case["online"]["concurrency_1"]["tokens_per_event"],
            "engine_b1_decode_ms": main_case["offline"]["b1_decode_ms"],
            "actor_b1_decode_ms": main_case["offline"]["actor"]["b1_decode_ms"],
            "b1_step_phases": {
                "in_process": main_case["offline"]["b1_step_phases"],
                "actor": main_case["offline"]["actor"]["b1_step_phases"],
            },
        },
        "max_ongoing_requests": main_case["online"]["max_ongoing_requests"],
        "ingress": main_case["online"]["ingress"],
        "failed_requests": loaded["failed"],
        "cases": sides,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("case", "offline tok/s", "online tok/s", "ratio", "TTFT p50/p99 ms", "ITL p50 ms", "tok/event"),
    ]
    for name, case in sides.items():
        on = case["online"]["concurrent"]
        rows.append(
            (
                name,
                f"{case['offline']['tok_s']:.0f}",
                f"{on['output_throughput']:.0f}",
                f"{on['output_throughput'] / case['offline']['tok_s']:.3f}",
                f"{on['ttft_ms']['p50']}/{on['ttft_ms']['p99']}",
                f"{on['itl_ms']['p50']}",
                f"{on['tokens_per_event']}",
            )
        )
    solo = main_case["online"]["concurrency_1"]
    print(f"wrote {args.out}")
    for row in rows:
        print(" | ".join(str(c) for c in row))
    print(
        f"concurrency 1: ITL p50 {solo['itl_ms']['p50']} ms, engine b1 step "
        f"{main_case['offline']['b1_decode_ms']} ms in process, "
        f"{main_case['offline']['actor']['b1_decode_ms']} ms in a Ray actor, "
        f"{solo['tokens_per_event']} tokens/event"
    )
    return 0 if loaded["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
