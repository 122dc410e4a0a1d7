"""`speculative_config`, as vLLM names it, declared once: this dataclass is what the rank runs with, and
the serve config's pydantic model validates a JSON object into it (deploy/config/option_schema.py).

Torch-free, so the serve config can import it cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from tandem.engine.options import check_fields, option

SpecMethod = Literal["ngram", "draft_model", "eagle3", "mtp"]
NEEDS_MODEL: tuple[str, ...] = ("draft_model", "eagle3")
# Methods that draft from the request's tokens or the target's own layer: a `model` would be ignored.
NO_MODEL: tuple[str, ...] = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes up to `num_speculative_tokens` tokens per request and
    step, and one target forward scores them all plus one more (docs/serve-config.md)."""

    # `option` returns a dataclasses.field (RUF009 cannot see it through the Literal alias).
    method: SpecMethod = option(  # noqa: RUF009
        "ngram",
        "'ngram' (prompt lookup in the request's own tokens), 'draft_model' (a small model with the "
        "target's tokenizer), 'eagle3' (an EAGLE-3 head) or 'mtp' (the model's own MTP layer).",
    )
    num_speculative_tokens: int = option(
        3, "Draft tokens per request and step (K); one forward scores K + 1 positions.", ge=1, le=16
    )
    model: str | None = option(
        None,
        "The draft model's (or EAGLE-3 head's) directory or hub id: required for 'draft_model' and "
        "'eagle3', unset for 'ngram' and 'mtp'.",
    )
    prompt_lookup_min: int = option(
        1, "'ngram': the shortest suffix of the request's tokens matched earlier in them.", ge=1
    )
    prompt_lookup_max: int = option(
        4, "'ngram': the longest suffix tried first; at least prompt_lookup_min.", ge=1
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), got {self.prompt_lookup_max}"
            )
        if self.method in NEEDS_MODEL and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        if self.method in NO_MODEL and self.model is not None:
            source = "the prompt" if self.method == "ngram" else "the target's own MTP layer"
            raise ValueError(
                f"speculative_config.model must be unset for method {self.method!r} (it drafts from {source})"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the user's dict (LLM keyword, serve config, --speculative-config JSON): an unknown key is a
        ValueError naming it."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s): {', '.join(unknown)}")
        try:
            return cls(**value)
        except ValueError as exc:
            text = str(exc)
            raise ValueError(
                text if text.startswith("speculative_config") else f"speculative_config.{text}"
            ) from None
