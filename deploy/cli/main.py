"""The `tandem` command: `tandem serve ...`, `tandem batch ...` and `tandem bench offline|online ...`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tandem.deploy.cli.batch_command import add_batch_parser
from tandem.deploy.cli.defaults import DEFAULT_APP_NAME, DEFAULT_PORT
from tandem.deploy.cli.engine_flags import add_engine_flags
from tandem.deploy.cli.serve_flags import add_vllm_app_flags
from tandem.deploy.config.version import tandem_version

BENCHMARKS = {
    "offline": "Offline throughput of the LLM API (nano-vllm workload), with ablations.",
    "online": "Online serving load against a running server: TTFT, ITL, TPOT, goodput.",
    "decode": "Decode step latency against the memory roofline.",
    "window": "Sliding-window decode at short and long context.",
    "moe": "Mixture of experts (Qwen3-30B-A3B shape, dummy weights): offline, decode, expert GEMMs.",
    "batch": "tandem.batch over Ray Data against LLM.generate on the offline workload.",
    "lora": "Multi-LoRA against the base model: offline throughput and the batch-1 step.",
}


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="An LLM serving cluster on Ray.")
    parser.add_argument("--version", action="version", version=f"tandem {tandem_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,batch,bench}")

    serve = commands.add_parser(
        "serve",
        help="Serve a model with an OpenAI-compatible API on Ray Serve.",
        description="Join the running Ray cluster (or start one), deploy, print the URL and block. "
        "With no --model (and no model in --config) it serves the embedded tiny model on CPU.",
    )
    # Defaults of None mean "not given", so values from --config are only overridden by explicit flags.
    serve.add_argument("--model", help="Hugging Face hub id or local model directory.")
    serve.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=_positive_int,
        help="Tensor-parallel degree (GPUs per replica).",
    )
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], help="Device of the rank actors.")
    serve.add_argument("--served-model-name", help="Model name clients use (default: --model).")
    serve.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1).")
    serve.add_argument("--port", type=_port, default=None, help=f"HTTP port (default {DEFAULT_PORT}).")
    serve.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="Ray's Prometheus metrics export port, when this command starts Ray (default: a free "
        "port on --host, printed at start; /metrics on the API port serves tandem's series anyway).",
    )
    serve.add_argument(
        "--config",
        help="A serve config YAML (its tandem application's args and http_options are used) "
        "or a YAML of the application args alone.",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="An API key that /v1/* requests must send as 'Authorization: Bearer <key>'; repeat for "
        "several. TANDEM_API_KEY (comma separated) adds more; prefer it, since flags show in `ps`.",
    )
    serve.add_argument(
        "--chat-template", default=None, help="A Jinja chat template file (or inline template) to use."
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3", "openai_gptoss"],
        default=None,
        help="Split <think>...</think> out of chat replies into reasoning_content (as vLLM's flag); "
        "openai_gptoss: the harmony format, which gpt-oss models get without the flag.",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="On SIGTERM, when this command started Ray: seconds running requests may take to finish "
        "before they end with an error (default 30); new requests get 503 meanwhile.",
    )
    serve.add_argument(
        "--speculative-config",
        dest="engine__speculative_config",  # engine_flags.engine_overrides reads it with the generated flags
        type=json.loads,
        default=None,
        metavar="JSON",
        help="Speculative decoding as vLLM's JSON object, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3}\' (engine.speculative_config).',
    )
    lora = serve.add_argument_group("LoRA adapters (vLLM's flags; docs/serve-config.md#lora-adapters)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=None,
        help="PEFT adapters to serve by name (a local directory or a URI each); requests name one as "
        "their `model`. Turns LoRA on.",
    )
    lora.add_argument(
        "--lora-dynamic-path",
        default=None,
        help="A folder of adapters: `<model>:<name>` loads <folder>/<name> on first use. Turns LoRA on.",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="Level of the Ray, Serve and HAProxy log lines shown while serving (default warning: "
        "tandem's own progress lines and warnings only; info shows Serve's start-up and access logs).",
    )
    serve.add_argument("--name", default=None, help=f"Serve application name (default {DEFAULT_APP_NAME}).")
    serve.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, or a `ray start` one)."
    )
    serve.add_argument(
        "--ingress",
        choices=["auto", "proxy", "haproxy"],
        default="auto",
        help="How HTTP reaches the replicas when this command starts Ray: HAProxy straight to the "
        "replicas, or Serve's Python proxy; 'auto' (default) takes HAProxy when its binary is found "
        "(docs/serve-config.md#ingress).",
    )

    add_vllm_app_flags(serve)
    add_engine_flags(serve)  # --max-num-seqs, --enable-lora, ...: from the engine's options

    add_batch_parser(commands)

    bench = commands.add_parser("bench", help="Run the benchmarks.")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for kind, text in BENCHMARKS.items():
        kinds.add_parser(kind, help=text, add_help=False)  # its flags go to the benchmark: see main()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if len(words) >= 2 and words[0] == "bench" and words[1] in BENCHMARKS:
        # Everything after the kind belongs to the benchmark's own parser, --help included.
        return run_bench(words[1], words[2:])
    args = build_parser().parse_args(words)
    if args.command == "serve":
        from tandem.deploy.cli.serve_command import run_serve

        return run_serve(args)
    if args.command == "batch":
        from tandem.deploy.cli.batch_command import run_batch

        return run_batch(args)
    if args.command == "bench":
        return run_bench(args.bench_kind, [])
    return 2  # argparse rejects unknown commands before this


def run_bench(kind: str, argv: list[str]) -> int:
    """The benchmarks live in the source checkout's benchmarks/ folder (not in the wheel)."""
    import importlib

    try:
        module = importlib.import_module(f"tandem.benchmarks.{kind}")
    except ImportError as exc:
        print(
            f"tandem bench {kind}: the benchmarks ship with the source checkout "
            f"(pip install -e .), not with this install ({exc})",
            file=sys.stderr,
        )
        return 2
    # Each benchmark parses sys.argv itself, so it reads as `python benchmarks/<kind>.py ARGS`.
    saved = sys.argv
    sys.argv = [f"tandem bench {kind}", *argv]
    try:
        result = module.main()
    finally:
        sys.argv = saved
    return int(result or 0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
