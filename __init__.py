"""tandem: an LLM serving cluster on Ray.

The offline API is re-exported lazily, so `import tandem.engine` does not pull in the scheduler.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.llm import LLM
    from tandem.scheduler.messages import LoRARequest
    from tandem.scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    if name == "LoRARequest":
        from tandem.scheduler.messages import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from tandem.scheduler.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
