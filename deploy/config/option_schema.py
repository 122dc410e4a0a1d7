"""Pydantic models generated from the option dataclasses, so the serve config declares nothing twice.

Each user option of `RuntimeOptions` and `EngineOptions` (engine/options.py) becomes a field with the
dataclass's type (Literal choices included), default, bounds and doc; vLLM's name of an option is taken
as well as tandem's (`max_num_seqs` for `max_running`, ...), and vLLM's spellings of its values
(`dtype: half`); unknown keys are rejected.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from tandem.engine.options import from_vllm, user_fields


def options_model(name: str, *classes: type) -> type[BaseModel]:
    """A pydantic model with every user option of `classes`, in declaration order."""
    fields: dict[str, Any] = {}
    for cls in classes:
        for field_name, hint, f in user_fields(cls):
            if field_name in fields:
                raise TypeError(f"option {field_name!r} is declared twice")
            meta = f.metadata
            fields[field_name] = (hint, Field(default=f.default, description=meta["doc"], **meta["bounds"]))

    def _vllm_names(cls: type[BaseModel], data: Any) -> Any:
        # vLLM's value spellings, and one value per option whichever of its names it came under.
        return from_vllm(data, *classes) if isinstance(data, dict) else data

    validators = {"_vllm_names": model_validator(mode="before")(classmethod(_vllm_names))}
    model: type[BaseModel] = create_model(
        name,
        __config__=ConfigDict(extra="forbid"),
        __validators__=validators,  # type: ignore[arg-type]
        **fields,
    )
    return model
