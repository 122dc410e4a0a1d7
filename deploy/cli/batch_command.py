"""`tandem batch -i IN -o OUT --model M`: an OpenAI batch file, answered as the HTTP server would, over
Ray Data (vLLM's `run-batch`, on a cluster). Joins the running Ray cluster, else starts a local one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Literal

from pydantic import ValidationError

from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.cli.engine_flags import add_engine_flags, engine_overrides
from tandem.engine.options import EngineOptions, from_vllm
from tandem.scheduler.options import RuntimeOptions


def add_batch_parser(commands: Any) -> None:
    batch = commands.add_parser(
        "batch",
        help="Run an OpenAI batch file (JSONL) through the model, over Ray Data.",
        description="Each input line is {custom_id, method: POST, url: /v1/chat/completions | "
        "/v1/completions, body}; each output line {id, custom_id, response: {status_code, request_id, "
        "body}, error}, in input order. Bodies are checked and answered as `tandem serve` answers them.",
    )
    batch.add_argument("-i", "--input-file", required=True, help="Input JSONL: a local path or a URI.")
    batch.add_argument("-o", "--output-file", required=True, help="Output JSONL: a local path or a URI.")
    batch.add_argument(
        "--model",
        default=None,
        help="Hugging Face hub id or local model directory (default: the demo model on CPU, named "
        "'tandem-tiny', as `tandem serve` serves it).",
    )
    batch.add_argument(
        "--served-model-name", help="The name the bodies' `model` must give (default: --model)."
    )
    batch.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="Device of the ranks."
    )
    batch.add_argument("--concurrency", type=_positive_int, default=1, help="Engine actors (default 1).")
    batch.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=_positive_int,
        default=None,
        help="GPUs per engine (default 1, or tensor_parallel_size in --engine-kwargs).",
    )
    batch.add_argument("--batch-size", type=_positive_int, default=64, help="Lines per batch (default 64).")
    batch.add_argument(
        "--max-concurrent-batches",
        type=_positive_int,
        default=8,
        help="Batches each engine runs at once (default 8).",
    )
    batch.add_argument("--chat-template", help="A Jinja chat template file (or inline template).")
    batch.add_argument(
        "--engine-kwargs",
        type=_json_object,
        default={},
        help="Engine options as JSON, e.g. '{\"max_model_len\": 4096}'.",
    )
    batch.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, or a `ray start` one).")
    add_engine_flags(batch)  # vLLM's run-batch engine flags: --max-model-len, --max-num-seqs, ...


def model_of(args: argparse.Namespace) -> tuple[str, str | None, Literal["auto", "cpu", "cuda"]]:
    """(model, the name the bodies give, device): --model's, else the demo model's, on CPU."""
    if args.model is not None:
        return args.model, args.served_model_name, args.device
    from tandem.deploy.config.args import TINY_MODEL_NAME
    from tandem.engine.tiny import default_model_dir

    device: Literal["auto", "cpu", "cuda"] = "cpu" if args.device == "auto" else args.device
    return str(default_model_dir()), args.served_model_name or TINY_MODEL_NAME, device


def run_batch(args: argparse.Namespace) -> int:
    given = {"tp_size": args.tp_size} if args.tp_size is not None else {}
    model, served_model_name, device = model_of(args)
    try:
        # The flags win over --engine-kwargs, option by option (vLLM's names there read as tandem's).
        engine = {**from_vllm(args.engine_kwargs, RuntimeOptions, EngineOptions), **engine_overrides(args)}
        config = ProcessorConfig(
            model_source=model,
            concurrency=args.concurrency,
            device=device,
            batch_size=args.batch_size,
            max_concurrent_batches=args.max_concurrent_batches,
            chat_template=args.chat_template,
            engine_kwargs=engine,
            **given,
        )
    except ValidationError as exc:
        print(f"tandem batch: {_first_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # one option under both of its names, with two values
        print(f"tandem batch: engine_kwargs: {exc}", file=sys.stderr)
        return 2
    from tandem.deploy.batch.batch_file import readable_uri, run_batch_file

    try:
        readable_uri(args.input_file)
    except FileNotFoundError as exc:
        print(f"tandem batch: {exc}", file=sys.stderr)
        return 2
    _show_progress(sys.stderr.isatty())
    started = _connect_ray(args.address, config)
    try:
        summary = run_batch_file(args.input_file, args.output_file, config, served_model_name)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(
        f"tandem batch: wrote {summary.lines} lines to {args.output_file} in {summary.seconds:.1f}s: "
        f"{summary.answered} answered, {summary.refused} refused by the API, {summary.invalid} invalid",
        file=sys.stderr,
    )
    return 0


def _show_progress(terminal: bool) -> None:
    """On a terminal, Ray Data's live progress bars (its rich ones: its tqdm ones draw nothing there in
    Ray 2.60); elsewhere its default, a progress line in the log every few seconds."""
    if terminal:
        from ray.data import DataContext

        context = DataContext.get_current()
        context.enable_rich_progress_bars = True
        context.use_ray_tqdm = False


def _connect_ray(address: str | None, config: ProcessorConfig) -> bool:
    """Join the given / RAY_ADDRESS / `ray start` cluster, else start a local one; True if started."""
    from tandem.cluster.ray_cluster import ensure_ray
    from tandem.deploy.batch.actor_pool import local_cluster_cpus

    return ensure_ray(address, num_cpus=local_cluster_cpus(config), include_dashboard=False)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error.get('msg', 'invalid value')}" if where else str(error.get("msg"))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
