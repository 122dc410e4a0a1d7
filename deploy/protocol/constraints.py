"""From request fields to the constraints a choice samples under: the structured-output constraint (and
which field asked for it, for the 400 if it does not compile), logit_bias, and the check that turns
OpenAI fields we do not implement into a 400 `unsupported_parameter` naming the field."""

from __future__ import annotations

from typing import Any

from tandem.deploy.protocol.errors import OpenAIError, invalid_request
from tandem.deploy.protocol.structured_fields import StructuredFields
from tandem.scheduler.sampling_params import StructuredOutputs

# field -> values that mean "off", for the fields we accept only when off. None (unset) is always off.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "default"),
    "store": (False,),
    "guided_whitespace_pattern": (),
    "guided_decoding_backend": ("auto", "xgrammar"),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "verbosity": (),
    "metadata": ({},),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
}


def unsupported(field: str, value: Any) -> OpenAIError:
    return invalid_request(f"{field}={value!r} is not supported", param=field, code="unsupported_parameter")


def check_supported(req: StructuredFields, n: int) -> None:
    """Raise the 400 for the first field set to a value we would otherwise silently ignore."""
    for field, neutral in _NEUTRAL.items():
        value = getattr(req, field, None)
        if value is not None and value not in neutral:
            raise unsupported(field, value)
    if req.best_of is not None and req.best_of != n:
        raise unsupported("best_of", req.best_of)  # best_of == n is plain sampling of n choices


def structured_outputs(req: StructuredFields) -> tuple[StructuredOutputs | None, str | None]:
    """The request's one output constraint and the field that set it; a 400 if two fields set one."""
    found: list[tuple[StructuredOutputs, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredOutputs(json_object=True), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise invalid_request(
                "response_format of type json_schema needs json_schema.schema", param="response_format"
            )
        found.append((StructuredOutputs(json=fmt.json_schema.json_schema), "response_format"))
    so = req.structured_outputs
    if so is not None:
        constraint = StructuredOutputs(
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
        )
        found.append((constraint, "structured_outputs"))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value: Any = getattr(req, field)
        if value is not None:
            found.append((StructuredOutputs(**{key: value}), field))
    if len(found) > 1:
        raise invalid_request(
            f"{found[0][1]} and {found[1][1]} both constrain the output: set one", param=found[1][1]
        )
    if not found:
        return None, None
    constraint, field = found[0]
    try:
        constraint.spec()
    except ValueError as exc:  # an empty choice list, a schema that is not an object...
        raise invalid_request(f"{field}: {exc}", param=field) from None
    return constraint, field


def logit_bias(req: StructuredFields) -> dict[int, float] | None:
    """OpenAI's string-keyed logit_bias as token ids; a 400 for a key that is not one (the vocabulary
    bound is checked where the tokenizer is known)."""
    if not req.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0:
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        bias[token] = value
    return bias
