"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status.

Every failure a client can see goes through `OpenAIError`, so HTTP and the handle API report the same
body; only HTTP adds the status line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class OpenAIError(Exception):
    """A failure to report to the client: an HTTP status plus the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = _encodable(param) if param is not None else None
        self.code = code
        self.retry_after_s = retry_after_s  # HTTP's Retry-After, on a 503 that a retry soon may pass

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles exceptions across processes; keep the keyword-only fields.
        return (_rebuild, (self.status, self.message, self.type, self.param, self.code, self.retry_after_s))


def _encodable(text: str) -> str:
    # A JSON body may escape a lone surrogate ("\ud800"): Python keeps it in a str, but it has no UTF-8
    # form, so an error message echoing it (an unknown model name) would fail the response itself.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _rebuild(
    status: int, message: str, type: str, param: str | None, code: str | None, retry_after_s: int | None
) -> OpenAIError:
    return OpenAIError(status, message, type=type, param=param, code=code, retry_after_s=retry_after_s)


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def not_json(content_type: str) -> OpenAIError:
    """A body sent as another content type (`curl -d` sends form data) is not read as JSON: say so."""
    return invalid_request(
        f"the request body must be JSON, sent with 'content-type: application/json'; this one was sent "
        f"as {content_type!r} (curl -d sends that: add -H 'content-type: application/json')",
        param="content-type",
        code="unsupported_content_type",
    )


MAX_NAMES_SHOWN = 20  # a 404 lists this many adapters at most, then says how many more


def model_not_found(
    model: str, served: str, adapters: Sequence[str] = (), dynamic: bool = False
) -> OpenAIError:
    """OpenAI's 404 for an unknown `model`, naming what this server does serve: the base model, its LoRA
    adapters, and (`dynamic`) that `<served>:<name>` loads one from its adapter folder."""
    names = [f"'{name}'" for name in [served, *adapters][: MAX_NAMES_SHOWN + 1]]
    more = len(adapters) + 1 - len(names)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    message = f"The model '{model}' does not exist; this server serves {listed}"
    if more > 0:
        message += f" and {more} more (GET /v1/models lists them)"
    if dynamic:
        message += f", and '{served}:<name>' for an adapter in its adapter folder"
    return OpenAIError(404, message + ".", param="model", code="model_not_found")


def adapter_not_found(name: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The LoRA adapter '{name}' cannot be found.",
        type="not_found_error",
        param="lora_name",
        code="model_not_found",
    )


# What an overloaded replica tells clients to wait before retrying: about the time a running request
# takes to make room, short enough that the OpenAI SDK's retries (which honour it) keep the load on.
OVERLOAD_RETRY_AFTER_S = 1


def overloaded(message: str) -> OpenAIError:
    return OpenAIError(
        503, message, type="server_error", code="overloaded", retry_after_s=OVERLOAD_RETRY_AFTER_S
    )


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="service_unavailable")


def internal_error(message: str = "internal server error") -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """A 400 for pydantic / FastAPI validation errors, naming the first offending field.

    FastAPI reports a body that is not JSON as a validation error of type `json_invalid`; it becomes a
    400 with code `invalid_json` instead of FastAPI's default 422.
    """
    if not errors:
        return invalid_request("invalid request body")
    if any(e.get("type") == "json_invalid" for e in errors):
        message = next(e.get("msg", "") for e in errors if e.get("type") == "json_invalid")
        return invalid_request(f"the body is not valid JSON: {message}", code="invalid_json")
    unknown = unrecognized_fields(errors)
    if unknown:
        return unrecognized(unknown)
    # A union reports one error per member (e.g. `stop` as a string, and as a list of strings); the
    # deepest one is the member the client meant, e.g. `stop.0` for `"stop": [""]`.
    # Prefer a value error (a range, a length) over "wrong type", then the deepest: for `"prompt": [1, -1]`
    # that is `prompt.1` being negative, not `prompt` failing to be a string.
    first = max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(_field_path(e))))
    param = ".".join(_field_path(first)) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is not None:
        message = f"{param}: {message}"
    # Other members of the same union are noise; other fields are worth naming.
    others = sorted(
        {path[0] for path in map(_field_path, errors) if path} - {param.split(".")[0] if param else ""}
    )
    if others:
        message += f" (also invalid: {', '.join(others)})"
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return invalid_request(message, param=param, code=code)


def unrecognized_fields(errors: Sequence[Mapping[str, Any]]) -> list[str]:
    """The body's fields that no request model declares, in the order they came: top-level names, and
    dotted paths in nested objects (`stream_options.foo`, `tools.0.function.foo`)."""
    names: list[str] = []
    for error in errors:
        name = ".".join(_field_path(error))
        if error.get("type") == "extra_forbidden" and name and name not in names:
            names.append(name)
    return names


def unrecognized(names: Sequence[str]) -> OpenAIError:
    """OpenAI's 400 for fields it does not know, naming each of them."""
    noun = "argument" if len(names) == 1 else "arguments"
    return invalid_request(
        f"Unrecognized request {noun} supplied: {', '.join(names)}", param=names[0], code="unknown_parameter"
    )


def _field_path(error: Mapping[str, Any]) -> list[str]:
    # Union members add their type name to `loc` (e.g. "prompt.str", "tool_choice.NamedToolChoice.x");
    # keep the user's field path only. The last part is always the user's (an unknown key, say).
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    return [part for i, part in enumerate(loc) if i == len(loc) - 1 or not _is_type_tag(part)]


def _is_type_tag(part: str) -> bool:
    if part[:1].isupper() and part.isidentifier():  # a model class: request fields are snake_case
        return True
    return part in {"str", "int", "float", "bool", "list[str]", "list[int]", "dict"} or part.startswith(
        ("list[", "function-", "constrained-", "json-or-python")
    )
