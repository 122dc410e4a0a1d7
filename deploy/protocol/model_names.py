"""Which model a request's `model` names: the base model, or a LoRA adapter on it.

An adapter is named by its own name (`"sql-lora"`), or in Ray Serve LLM's form `"<base>:<adapter>"`,
which is also how an adapter under `lora_dynamic_path` is asked for before it is loaded. Plain strings
only, so the protocol, the request path and the router (which reads a body's `model` to route by
adapter) all split names the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelName:
    """A request's `model`: `adapter` None for the base model; `qualified` when it was `<base>:<name>`."""

    adapter: str | None
    qualified: bool = False


def parse_model(model: str | None, served: str) -> ModelName:
    """Split `model` against the served base name. Anything that is not the base is an adapter name (it
    may still be unknown to the server: that is the registry's to say)."""
    if model is None or model == served:
        return ModelName(None)
    prefix = f"{served}:"
    if model.startswith(prefix) and len(model) > len(prefix):
        return ModelName(model[len(prefix) :], qualified=True)
    return ModelName(model)


def body_adapter(body: object, served: str) -> str | None:
    """The adapter a request body (a dict, as the handle API and HAProxy's route hook hand it) names,
    for routing; None for the base model or a body without a model."""
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    return parse_model(model, served).adapter if isinstance(model, str) else None
