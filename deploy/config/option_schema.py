"""Pydantic models generated from the option dataclasses, so the serve config declares nothing twice.

Each user option of `RuntimeOptions` and `EngineOptions` (engine/options.py) becomes a field with the
dataclass's type (Literal choices included), default, bounds and doc; vLLM's name of an option is taken
as well as tandem's (`max_num_seqs` for `max_running`, ...), and vLLM's spellings of its values
(`dtype: half`); unknown keys are rejected.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from tandem.engine.options import from_vllm, user_fields


class _OptionsBase(BaseModel):
    """The generated models' base: unknown keys refused, vLLM's names read as tandem's."""

    model_config = ConfigDict(extra="forbid")
    option_classes: ClassVar[tuple[type, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        # vLLM's value spellings, and one value per option whichever of its names it came under.
        return from_vllm(data, *cls.option_classes) if isinstance(data, dict) else data


def options_model(name: str, *classes: type) -> type[BaseModel]:
    """A pydantic model with every user option of `classes`, in declaration order."""
    fields: dict[str, Any] = {}
    for cls in classes:
        for field_name, hint, f in user_fields(cls):
            if field_name in fields:
                raise TypeError(f"option {field_name!r} is declared twice")
            meta = f.metadata
            fields[field_name] = (hint, Field(default=f.default, description=meta["doc"], **meta["bounds"]))
    model: type[_OptionsBase] = create_model(name, __base__=_OptionsBase, **fields)
    model.option_classes = classes
    return model
