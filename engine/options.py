"""The engine's options, declared once: name, type, default, bounds and the doc a user reads.

`EngineOptions` is what the user asks for ("auto" where the device decides); `engine_config.py` resolves
it against the device into `EngineConfig`. The scheduler's `RuntimeOptions` embeds it, and the serve
config's `EngineArgs` (deploy/config/args.py) is generated from both, so adding a switch is one `option(...)`
field here. Validation lives here too, so the offline `LLM` path (no pydantic) checks the same bounds.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

# The largest decode graph the one-launch decode and the Triton norms serve: measured to win up to 32
# rows and not beyond (kernel_choices' norm and act parts; step traces by batch size).
FUSED_DECODE_MAX_BS = 32


def option(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    user: bool = True,
    vllm: str | None = None,
    vllm_values: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field with its user-facing doc and bounds. `user=False`: an internal knob (tests,
    benchmarks) that the serve config does not offer. `vllm`: vLLM's name of the same option (its engine
    argument, and `--flag-form` on the command line), which every entry point takes as well as tandem's;
    `vllm_values`: vLLM's spellings of some of its values (e.g. dtype 'half'), as tandem's."""
    bounds = {k: v for k, v in (("ge", ge), ("le", le), ("gt", gt), ("lt", lt)) if v is not None}
    metadata = {"doc": doc, "bounds": bounds, "user": user, "vllm": vllm, "vllm_values": vllm_values or {}}
    return dataclasses.field(default=default, metadata=metadata)


def check_fields(obj: Any) -> None:
    """Raise ValueError naming the field whose value is outside its type, choices or bounds."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if "doc" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            raise ValueError(f"{f.name} must be {_describe(hints[f.name])}, got {value!r}")
        if value is None:
            continue
        for op, bound in f.metadata["bounds"].items():
            ok = {"ge": value >= bound, "le": value <= bound, "gt": value > bound, "lt": value < bound}[op]
            if not ok:
                sign = {"ge": ">=", "le": "<=", "gt": ">", "lt": "<"}[op]
                raise ValueError(f"{f.name} must be {sign} {bound}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else f"a {hint.__name__}"


def user_fields(cls: type) -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    """(name, resolved type, field) of each option a user may set, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f) for f in dataclasses.fields(cls) if f.metadata.get("user")]


def from_vllm(kwargs: dict[str, Any], *classes: type) -> dict[str, Any]:
    """`kwargs` with vLLM's names and value spellings of the options of `classes` turned into tandem's;
    a ValueError when an option is given two values under its two names (tandem's name at its default,
    as the `LLM` constructor passes every keyword of its own, yields to vLLM's). Other keys pass through."""
    out = dict(kwargs)
    for cls in classes:
        for f in dataclasses.fields(cls):
            alias = f.metadata.get("vllm")
            if alias and alias != f.name and alias in out:
                value = out.pop(alias)
                if out.get(f.name, f.default) not in (f.default, value):
                    raise ValueError(f"{f.name} and vLLM's name for it, {alias}, are both set: set one")
                out[f.name] = value
            values = f.metadata.get("vllm_values") or {}
            if f.name in out and isinstance(out[f.name], str):
                out[f.name] = values.get(out[f.name], out[f.name])
    return out


@dataclass(frozen=True)
class EngineOptions:
    """What the user asks of one rank's engine; "auto" and None leave the choice to the device."""

    device: str = option(
        "auto", "'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'.", user=False
    )  # the serve config and `LLM` take it at their top level
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        "Weight and activation dtype; 'auto' is bfloat16 on GPU and float32 on CPU.",
        vllm="dtype",
        vllm_values={"half": "float16", "float": "float32"},
    )
    page_size: int | None = option(
        None, "Tokens per KV-cache page; unset picks the attention backend's default.", ge=1
    )
    num_pages: int | None = option(
        None, "KV-cache pages per KV group; unset sizes the pool from free memory (GPU).", ge=1
    )
    mem_fraction: float = option(
        0.85,
        "Fraction of GPU memory the engine may use for weights, graphs and the KV pool.",
        gt=0.0,
        lt=1.0,
        vllm="gpu_memory_utilization",
    )
    quantization: Literal["fp8"] | None = option(
        None,
        "Weight quantization of a bf16/fp16 checkpoint: 'fp8' quantizes weights to float8_e4m3 with "
        "per-channel scales at load (dynamic per-token activations on GPU). FP8 checkpoints are "
        "recognised from their config.json without it.",
        vllm="quantization",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = option(
        "auto",
        "KV-cache element type: 'auto' is the model dtype; 'fp8_e4m3' halves the cache's bytes, so the "
        "pool holds twice the tokens (flashinfer on GPU; per-layer scales from the checkpoint, else 1.0).",
        vllm="kv_cache_dtype",
        vllm_values={"fp8": "fp8_e4m3"},
    )
    enable_expert_parallel: bool = option(
        False,
        "Mixture-of-experts models: each of the tp_size ranks holds num_experts / tp_size whole experts "
        "(num_experts must divide by tp_size) instead of a 1/tp_size slice of every expert; attention "
        "stays tensor-parallel. No effect on dense models.",
        vllm="enable_expert_parallel",
    )
    load_format: Literal["auto", "dummy"] = option(
        "auto",
        "'auto' reads the safetensors checkpoint; 'dummy' builds the model from config.json alone with "
        "random weights drawn on the device, reading no weights (benchmarks of shapes no disk holds). "
        "The tokenizer still comes from the model directory.",
        vllm="load_format",
    )
    # GPU ablation switches (docs/tuning.md); the defaults are what runs in production.
    attention_backend: Literal["auto", "flashinfer", "torch"] = option(
        "auto", "Attention kernels: flashinfer on CUDA ('auto'), or the torch reference."
    )
    cuda_graph: bool = option(True, "Capture CUDA graphs for decode batches (GPU only).")
    piecewise_cuda_graph: bool = option(
        True, "CUDA graphs of the layer pieces between attention calls (prefill)."
    )
    copy_stream: bool = option(True, "Copy sampled tokens to the host on a dedicated CUDA stream.")
    fused_kernels: bool = option(
        True, "Fused flashinfer and Triton kernels (norms, rope, sampling) on CUDA, not torch ops."
    )
    cuda_graph_max_bs: int = option(256, "Largest decode batch captured as a CUDA graph.", ge=1)
    piecewise_max_tokens: int = option(
        2048, "Largest prefill batch, in tokens, run through piecewise graphs.", ge=1
    )
    fused_decode_max_bs: int = option(
        FUSED_DECODE_MAX_BS,
        "Largest decode graph whose full-attention layers run q/k norms, rope, K/V store and attention "
        "as one Triton launch, and whose norms and activation run as Triton kernels; 0 keeps "
        "flashinfer's kernels throughout.",
        ge=0,
        le=FUSED_DECODE_MAX_BS,
    )
    pdl_max_bs: int = option(
        8,
        "Largest CUDA graph whose Triton kernels and small GEMMs use programmatic dependent launch "
        "(Hopper and later); at most fused_decode_max_bs; 0 turns it off.",
        ge=0,
    )
    small_gemm_max_bs: int = option(
        8,
        "Largest CUDA graph whose GEMMs run as flashinfer's tinygemm instead of cuBLAS where it wins "
        "(Hopper and later); 0: cuBLAS throughout.",
        ge=0,
    )
    gemv_max_bs: int = option(
        1,
        "Largest CUDA graph whose GEMMs run as tandem's Triton GEMV, which loads its weights while the "
        "kernel before it runs (with PDL: Hopper and later); at most pdl_max_bs; 0 turns it off.",
        ge=0,
    )

    # Multi-LoRA (engine/lora/): the GPU slots and the rank they are padded to.
    enable_lora: bool = option(
        False,
        "Serve PEFT LoRA adapters on top of the base model (requests name one; batches mix them).",
        vllm="enable_lora",
    )
    max_loras: int = option(
        4,
        "Adapters one running batch may use at once: GPU slots of fixed buffers, loaded as needed.",
        ge=1,
        vllm="max_loras",
    )
    max_lora_rank: int = option(
        16, "Largest adapter rank served; every slot is sized for it.", ge=1, le=512, vllm="max_lora_rank"
    )

    def __post_init__(self) -> None:
        check_fields(self)
