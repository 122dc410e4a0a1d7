"""vLLM's LoRA flags on `tandem serve` and the serve config's LoRA fields: what they set, what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tandem.deploy.app import build_app
from tandem.deploy.cli.main import build_parser
from tandem.deploy.cli.serve_command import plan_from_cli
from tandem.deploy.config.args import AppArgs


def test_lora_flags_set_the_modules_and_the_engine(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"engine": {"max_running": 8}, "lora_modules": {"old": "/x"}}))
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(config),
            "--lora-modules",
            "sql=/a/sql",
            "chat=s3://b/chat",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "6",
        ]
    )
    plan = plan_from_cli(args).app_args
    assert plan.lora_modules == {"sql": "/a/sql", "chat": "s3://b/chat"}  # the flag replaces the config's
    assert plan.engine_kwargs() == {
        "max_running": 8,
        "max_loras": 2,
        "max_lora_rank": 64,
        "max_cpu_loras": 6,
        "enable_lora": True,
    }
    enabled = plan_from_cli(build_parser().parse_args(["serve", "--enable-lora"])).app_args
    assert enabled.engine_kwargs() == {"enable_lora": True} and enabled.lora_modules is None
    assert plan_from_cli(build_parser().parse_args(["serve"])).app_args.engine_kwargs() == {}
    dynamic = plan_from_cli(build_parser().parse_args(["serve", "--lora-dynamic-path", "gs://x/y"])).app_args
    assert dynamic.lora_dynamic_path == "gs://x/y" and dynamic.engine_kwargs()["enable_lora"] is True


def test_lora_config_fields_are_checked() -> None:
    listed = AppArgs.model_validate({"lora_modules": ["a=/x", '{"name": "b", "path": "/y"}']})
    assert listed.lora_modules == {"a": "/x", "b": "/y"}
    for bad, why in (
        ({"lora_modules": ["no-path"]}, "name=path"),
        ({"lora_modules": ["a=/x", "a=/y"]}, "twice"),
        ({"lora_modules": {"tandem-tiny": "/x"}}, "cannot name an adapter"),
        ({"lora_modules": {"a:b": "/x"}}, "cannot name an adapter"),
        ({"lora_modules": {"a": "/x"}, "engine": {"enable_lora": False}}, "enable_lora"),
        ({"engine": {"max_loras": 0}}, "max_loras"),
        ({"engine": {"max_lora_rank": 1024}}, "max_lora_rank"),
    ):
        with pytest.raises(ValidationError, match=why):
            AppArgs.model_validate(bad)


def test_the_app_hands_the_replicas_their_adapters() -> None:
    app = build_app({"lora_modules": {"sql": "/a/sql"}, "lora_dynamic_path": "/adapters", "num_replicas": 2})
    kwargs = app._bound_deployment.init_kwargs
    assert kwargs["lora_modules"] == {"sql": "/a/sql"} and kwargs["lora_dynamic_path"] == "/adapters"
    assert kwargs["engine"]["enable_lora"] is True
    router = app._bound_deployment._deployment_config.request_router_config
    assert router.request_router_kwargs["served_model_name"] == "tandem-tiny"


def test_tandem_bench_lora_reaches_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.deploy.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "lora", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "tandem bench lora" in out and "--preset" in out
