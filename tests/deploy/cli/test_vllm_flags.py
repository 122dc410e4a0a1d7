"""vLLM's `vllm serve` command line on `tandem serve`: each flag sets the one option tandem declares for
it, and a value tandem cannot honour is an error naming the flag."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from tandem.deploy.cli.main import build_parser
from tandem.deploy.cli.serve_command import plan_from_cli
from tandem.deploy.config.args import AppArgs
from tandem.deploy.protocol.tool_calls import PARSERS

VLLM_COMMAND = [
    "serve",
    "Qwen/Qwen3-0.6B",
    "--tensor-parallel-size",
    "2",
    "--max-model-len",
    "4096",
    "--dtype",
    "half",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "1024",
    "--gpu-memory-utilization",
    "0.7",
    "--no-enable-prefix-caching",
    "--quantization",
    "fp8",
    "--kv-cache-dtype",
    "fp8",
    "--seed",
    "5",
    "--served-model-name",
    "qwen",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    "{{ messages }}",
    "--disable-log-requests",
    "--allowed-origins",
    '["https://a.example"]',
]


def test_a_vllm_command_line_sets_tandems_options() -> None:
    args = build_parser().parse_args(VLLM_COMMAND)
    app = plan_from_cli(args).app_args
    assert (app.model, app.tp_size, app.served_model_name) == ("Qwen/Qwen3-0.6B", 2, "qwen")
    assert app.engine_kwargs() == {
        "max_model_len": 4096,
        "dtype": "float16",
        "max_running": 32,
        "chunk_size": 1024,
        "mem_fraction": 0.7,
        "prefix_cache": False,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8_e4m3",
        "seed": 5,
    }
    assert (app.tool_call_parser, app.enable_auto_tool_choice) == ("hermes", True)
    assert app.chat_template == "{{ messages }}"
    assert app.allowed_origins == ["https://a.example"]
    assert args.disable_log_requests is True  # Serve's access log: off (run_serve's logging_config)
    on = plan_from_cli(build_parser().parse_args(["serve", "m", "--enable-prefix-caching"])).app_args
    assert on.engine_kwargs() == {"prefix_cache": True} and on.model == "m"
    assert plan_from_cli(build_parser().parse_args(["serve", "--model", "m"])).app_args.model == "m"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--quantization", "awq"], "argument --quantization: invalid choice: 'awq'"),
        (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
        (["--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1"),
        (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be < 1.0"),
        (["--allowed-origins", "*"], "argument --allowed-origins: must be a JSON list"),
    ],
)
def test_a_flag_tandem_cannot_honour_is_an_error_naming_it(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert says in capsys.readouterr().err


def test_the_model_given_twice_differently_is_refused() -> None:
    with pytest.raises(SystemExit, match="given twice"):
        plan_from_cli(build_parser().parse_args(["serve", "a", "--model", "b"]))


def test_vllm_names_in_the_serve_config(tmp_path: Path) -> None:
    """Ray Serve LLM's `engine_kwargs` with vLLM's names; the flags still win, field by field."""
    config = tmp_path / "serve.yaml"
    engine = {"tensor_parallel_size": 2, "max_num_seqs": 8, "enable_prefix_caching": False}
    config.write_text(yaml.safe_dump({"model": "m", "engine_kwargs": engine}))
    app = plan_from_cli(build_parser().parse_args(["serve", "--config", str(config)])).app_args
    assert app.tp_size == 2 and app.engine_kwargs() == {"max_running": 8, "prefix_cache": False}
    flags = ["serve", "--config", str(config), "--max-num-seqs", "4"]
    app = plan_from_cli(build_parser().parse_args(flags)).app_args
    assert app.engine_kwargs() == {"max_running": 4, "prefix_cache": False}
    with pytest.raises(ValueError, match="max_running and vLLM's name for it, max_num_seqs"):
        AppArgs.model_validate({"engine": {"max_num_seqs": 8, "max_running": 4}})


def test_the_tool_call_parser_choices_are_the_parsers() -> None:
    hint = AppArgs.model_fields["tool_call_parser"].annotation
    (literal,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert set(typing.get_args(literal)) == set(PARSERS)
