"""`tandem serve`'s engine flags, generated from the engine's one declaration of its options.

Every option declared with vLLM's name (`option(..., vllm="max_num_seqs")` in engine/options.py and
scheduler/options.py) becomes vLLM's flag, `--max-num-seqs`, with the option's type, choices (vLLM's
value spellings included), bounds and doc, and writes the option under tandem's name into the serve
config's `engine` block. A value tandem cannot honour (a quantization it lacks, say) is argparse's error
naming the flag and what it takes, before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, Union

from tandem.engine.options import EngineOptions, user_fields
from tandem.scheduler.options import RuntimeOptions

_DEST_PREFIX = "engine__"  # argparse dests of the generated flags: engine__<tandem's option name>


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option that vLLM names, in a group of its own; each defaults to None (not given)."""
    group = parser.add_argument_group(
        "engine options (vLLM's flags; each sets the serve config's engine.<option>)"
    )
    for cls in (RuntimeOptions, EngineOptions):
        for name, hint, field in user_fields(cls):
            vllm = field.metadata.get("vllm")
            if vllm:
                _add_flag(group, name, hint, field, "--" + vllm.replace("_", "-"))


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the command line gave, by tandem's name."""
    return {
        dest.removeprefix(_DEST_PREFIX): value
        for dest, value in vars(args).items()
        if dest.startswith(_DEST_PREFIX) and value is not None
    }


def _add_flag(group: Any, name: str, hint: Any, field: dataclasses.Field[Any], flag: str) -> None:
    meta = field.metadata
    help_text = f"{meta['doc']} (engine.{name}; default {field.default!r})".replace("%", "%%")
    dest = _DEST_PREFIX + name
    if _base(hint) is bool:
        group.add_argument(
            flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    choices = _choices(hint)
    if choices is not None:
        spellings = dict(meta.get("vllm_values") or {})
        group.add_argument(
            flag,
            dest=dest,
            choices=[*choices, *spellings],
            type=lambda text, spellings=spellings: spellings.get(text, text),
            default=None,
            help=help_text,
        )
        return
    kind = _base(hint)
    group.add_argument(
        flag,
        dest=dest,
        type=_parse(kind, meta["bounds"]),
        default=None,
        metavar=kind.__name__.upper(),
        help=help_text,
    )


def _base(hint: Any) -> Any:
    """The type of an `X | None` hint (its one non-None member), else the hint itself."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _choices(hint: Any) -> list[Any] | None:
    base = _base(hint)
    return list(typing.get_args(base)) if typing.get_origin(base) is Literal else None


def _parse(kind: Any, bounds: dict[str, float]) -> Any:
    """A converter that checks the option's bounds, so `--max-num-seqs 0` is the flag's error."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind.__name__}, got {text!r}") from None
        for op, bound in bounds.items():
            ok = {"ge": value >= bound, "le": value <= bound, "gt": value > bound, "lt": value < bound}[op]
            if not ok:
                sign = {"ge": ">=", "le": "<=", "gt": ">", "lt": "<"}[op]
                raise argparse.ArgumentTypeError(f"must be {sign} {bound}, got {value}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its "invalid value" message
    return convert
