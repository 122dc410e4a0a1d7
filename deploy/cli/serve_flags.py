"""`tandem serve`'s flags that vLLM's `vllm serve` has and that set the serve config's own fields (not
the engine's, which engine_flags.py generates): the positional model, `--tensor-parallel-size`, tool
calling, CORS and request logging. Each maps onto the one `AppArgs` field (deploy/config/args.py) or
Serve option that does the same; a value tandem cannot honour is an error naming the flag.
"""

from __future__ import annotations

import argparse
import json
import typing
from typing import Any

from tandem.deploy.config.args import AppArgs


def add_vllm_app_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model, as `vllm serve MODEL` takes it (the same as --model).",
    )
    tools = serve.add_argument_group("tool calling (vLLM's flags)")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help="Parse the model's own tool calls under tool_choice 'auto' (on in tandem whether given or "
        "not; the serve config's enable_auto_tool_choice: false turns it off).",
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=_literal_choices("tool_call_parser"),
        default=None,
        help="The format of the model's tool calls (default: each format tandem parses is tried).",
    )
    http = serve.add_argument_group("HTTP (vLLM's flags)")
    http.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        help="Origins a browser may call the API from (CORS), as a JSON list (default '[\"*\"]', as "
        "vLLM's; '[]' sends no CORS headers).",
    )
    http.add_argument(
        "--disable-log-requests",
        action="store_true",
        default=False,
        help="No access log line per request (Serve's logging_config.enable_access_log: false). tandem "
        "never logs prompts or outputs.",
    )


def app_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The serve config fields these flags (and the older ones for the same fields) gave."""
    model = getattr(args, "model", None)
    positional = getattr(args, "model_tag", None)
    if model is not None and positional is not None and model != positional:
        raise SystemExit(f"tandem serve: the model is given twice: {positional!r} and --model {model!r}")
    overrides = {
        "model": positional or model,
        "tp_size": getattr(args, "tp", None),
        "device": getattr(args, "device", None),
        "served_model_name": getattr(args, "served_model_name", None),
        "api_key": getattr(args, "api_key", None),
        "chat_template": getattr(args, "chat_template", None),
        "lora_modules": getattr(args, "lora_modules", None),
        "lora_dynamic_path": getattr(args, "lora_dynamic_path", None),
        "reasoning_parser": getattr(args, "reasoning_parser", None),
        "tool_call_parser": getattr(args, "tool_call_parser", None),
        "enable_auto_tool_choice": getattr(args, "enable_auto_tool_choice", None),
        "allowed_origins": getattr(args, "allowed_origins", None),
    }
    return {k: v for k, v in overrides.items() if v is not None}


def _literal_choices(field: str) -> list[str]:
    """The values an `AppArgs` field of type `Literal[...] | None` takes."""
    hint = AppArgs.model_fields[field].annotation
    literal = next(a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal)
    return list(typing.get_args(literal))


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON list such as '[\"*\"]', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value
