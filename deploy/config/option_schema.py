"""Pydantic models generated from the option dataclasses, so the serve config declares nothing twice.

Each user option of `RuntimeOptions` and `EngineOptions` (engine/options.py) becomes a field with the
dataclass's type (Literal choices included), default, bounds and doc; unknown keys are rejected.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from tandem.engine.options import user_fields


def options_model(name: str, *classes: type) -> type[BaseModel]:
    """A pydantic model with every user option of `classes`, in declaration order."""
    fields: dict[str, Any] = {}
    for cls in classes:
        for field_name, hint, f in user_fields(cls):
            if field_name in fields:
                raise TypeError(f"option {field_name!r} is declared twice")
            meta = f.metadata
            fields[field_name] = (hint, Field(default=f.default, description=meta["doc"], **meta["bounds"]))
    model: type[BaseModel] = create_model(name, __config__=ConfigDict(extra="forbid"), **fields)
    return model
