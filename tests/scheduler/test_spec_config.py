"""speculative_config: one dataclass, reached from LLM keywords, the serve config, the CLI and tandem.batch;
a bad combination fails at start-up naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.deploy.cli.main import build_parser
from tandem.deploy.cli.serve_command import plan_from_cli
from tandem.deploy.config.args import EngineArgs
from tandem.scheduler.options import RuntimeOptions
from tandem.scheduler.spec.config import SpeculativeConfig


def test_a_dict_becomes_the_dataclass() -> None:
    options = RuntimeOptions.of(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert options.speculative_config == SpeculativeConfig("ngram", 4)
    assert RuntimeOptions.of().speculative_config is None


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "eagle3"}, "speculative_config.model"),
        ({"method": "ngram", "model": "some/draft"}, "speculative_config.model"),
        ({"method": "medusa"}, "speculative_config.method"),
        ({"method": "mtp", "model": "some/draft"}, "speculative_config.model"),
        ({"method": "ngram", "lookahead": 2}, "lookahead"),
    ],
)
def test_a_bad_combination_names_the_field(config: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RuntimeOptions.of(speculative_config=config)
    with pytest.raises(ValidationError):
        EngineArgs.model_validate({"speculative_config": config})


def test_the_serve_config_and_the_cli_pass_it_through() -> None:
    args = EngineArgs.model_validate({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    kwargs = args.to_llm_kwargs()
    assert RuntimeOptions.of(**kwargs).speculative_config == SpeculativeConfig("ngram", 2)
    cli = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}']
    )
    engine = plan_from_cli(cli).app_args.engine
    assert engine.speculative_config == SpeculativeConfig("ngram", 5)


def test_tandem_batch_checks_it_as_an_engine_option() -> None:
    from tandem.deploy.batch.config import ProcessorConfig

    good = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    assert ProcessorConfig(model_source="m", engine_kwargs=good).engine_kwargs == good
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        ProcessorConfig(model_source="m", engine_kwargs={"speculative_config": {"num_speculative_tokens": 0}})
