"""`tandem batch`: its flags, and the mistakes it refuses before it starts Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.deploy.cli.batch_command import model_of
from tandem.deploy.cli.main import build_parser, main


def test_flags_as_vllm_run_batch_names_them() -> None:
    args = build_parser().parse_args(
        [
            "batch",
            "-i",
            "in.jsonl",
            "-o",
            "s3://b/out.jsonl",
            "--model",
            "m",
            "--concurrency",
            "4",
            "--tp-size",
            "2",
        ]
    )
    assert (args.input_file, args.output_file, args.model) == ("in.jsonl", "s3://b/out.jsonl", "m")
    assert (args.concurrency, args.tp_size, args.device, args.batch_size) == (4, 2, "auto", 64)
    assert args.engine_kwargs == {}
    parsed = build_parser().parse_args(
        ["batch", "-i", "a", "-o", "b", "--model", "m", "--engine-kwargs", '{"seed": 3}']
    )
    assert parsed.engine_kwargs == {"seed": 3}
    for bad in (
        ["--concurrency", "0"],
        ["--engine-kwargs", "[1]"],
        ["--engine-kwargs", "{"],
        ["--device", "tpu"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["batch", "-i", "a", "-o", "b", "--model", "m", *bad])


def test_a_missing_input_or_a_bad_option_fails_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.jsonl")
    assert main(["batch", "-i", missing, "-o", str(tmp_path / "o.jsonl"), "--model", "m"]) == 2
    assert "no input file" in capsys.readouterr().err
    given = tmp_path / "in.jsonl"
    given.write_text("{}\n")
    options = ["--engine-kwargs", '{"max_runing": 1}']
    assert main(["batch", "-i", str(given), "-o", str(tmp_path / "o.jsonl"), "--model", "m", *options]) == 2
    assert "unknown engine option(s): max_runing" in capsys.readouterr().err


def test_vllm_run_batch_engine_flags_reach_the_processor_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm run-batch`'s engine flags, and vLLM's names in --engine-kwargs, become tandem's options."""
    import tandem.deploy.cli.batch_command as batch_command

    seen: list[object] = []

    def stop_at_the_input(uri: str) -> None:
        raise FileNotFoundError("stop here")

    monkeypatch.setattr("tandem.deploy.batch.batch_file.readable_uri", stop_at_the_input)
    real = batch_command.ProcessorConfig
    monkeypatch.setattr(batch_command, "ProcessorConfig", lambda **kw: seen.append(real(**kw)) or seen[-1])
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "512", "--max-num-seqs", "8"]
    kwargs = ["--engine-kwargs", '{"enable_prefix_caching": false, "max_num_seqs": 4}']
    assert main(["batch", "-i", "a", "-o", "b", "--model", "m", *flags, *kwargs]) == 2
    (config,) = seen
    assert config.tp_size == 2  # type: ignore[attr-defined]
    assert config.engine_kwargs == {"prefix_cache": False, "max_running": 8, "max_model_len": 512}  # type: ignore[attr-defined]
    inside = ["--engine-kwargs", '{"tensor_parallel_size": 2}']
    assert main(["batch", "-i", "a", "-o", "b", "--model", "m", *inside]) == 2
    assert seen[-1].tp_size == 2  # type: ignore[attr-defined]


def test_without_model_it_runs_the_demo_model_as_tandem_serve_does() -> None:
    model, served, device = model_of(build_parser().parse_args(["batch", "-i", "a", "-o", "b"]))
    assert (Path(model) / "config.json").is_file() and (served, device) == ("tandem-tiny", "cpu")
    named = build_parser().parse_args(["batch", "-i", "a", "-o", "b", "--model", "m", "--device", "cuda"])
    assert model_of(named) == ("m", None, "cuda")
