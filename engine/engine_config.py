"""The engine's resolved configuration: every "auto" is settled here, once, against the device's facts."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.options import EngineOptions
from tandem.engine.pool_share import PoolShare
from tandem.engine.quant.fp8_format import Fp8Checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The head sizes flashinfer's kernels are built and tested for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# flashinfer's MLA kernels: kv_lora_rank 512 plus qk_rope_head_dim 64, the latent of every DeepSeek model.
FLASHINFER_MLA_LATENT_DIM = 576
KV_TOKENS_CPU = 32768  # the CPU pool's size when num_pages is unset: there is no free memory to size from


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel choices depend on beyond the options: probed once from the device
    (`probe`), or stated by a test to plan for a device it does not have."""

    cuda: bool = False
    capability: tuple[int, int] = (0, 0)
    num_sms: int = 0
    flashinfer: bool = False  # flashinfer imports
    triton: bool = False  # Triton imports: the fused q/k norm + rope, one-launch decode, small norms
    tinygemm: bool = False  # flashinfer's tinygemm2 module imports
    fp8_block_gemm: bool = False  # flashinfer's SM90 block-scaled FP8 GEMM is there (Hopper)

    @property
    def hopper(self) -> bool:
        """PDL's grid-dependency instructions and tinygemm's TMA loads need compute capability 9.0."""
        return self.capability[0] >= 9

    @classmethod
    def probe(cls, device: torch.device) -> DeviceFacts:
        if device.type != "cuda":
            return cls()
        props = torch.cuda.get_device_properties(device)
        flashinfer = _flashinfer_importable()
        return cls(
            cuda=True,
            capability=(props.major, props.minor),
            num_sms=props.multi_processor_count,
            flashinfer=flashinfer,
            triton=importlib.util.find_spec("triton") is not None,
            tinygemm=flashinfer and _importable("flashinfer.gemm.routergemm"),
            fp8_block_gemm=flashinfer and props.major == 9 and fp8_block_gemm_buildable(),
        )


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA, resolved: the slots, the rank they hold, and which kernels apply the deltas ("triton"
    on CUDA where Triton imports, else the "torch" reference)."""

    max_loras: int
    max_lora_rank: int
    kernels: str = "torch"


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings after resolution. `num_pages` None means: size the pool from free memory.

    The switches are already what runs: `cuda_graph` is False on CPU or with the torch backend, the
    row limits are 0 where their kernels cannot run, and so on. `switches()` records them with benchmark
    results; `plan.KernelPlanner` turns the row limits into one plan per captured shape.
    """

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    page_size: int
    num_pages: int | None
    mem_fraction: float = 0.85
    attention_backend: str = "torch"
    cuda_graph: bool = False  # full CUDA graphs for decode batches
    piecewise_cuda_graph: bool = False  # CUDA graphs of the pieces between attention calls (prefill)
    copy_stream: bool = True  # device-to-host result copies on their own stream
    fused_kernels: bool = False  # flashinfer's fused norm and rope kernels instead of torch ops
    triton: bool = False  # the Triton kernels (with fused_kernels): fused q/k norm + rope, race sampling
    cuda_graph_max_bs: int = 256  # largest decode batch with a graph; larger ones run eagerly
    piecewise_max_tokens: int = 2048  # largest prefill/extend batch with piecewise graphs
    # Graphs of up to these many rows take the one-launch decode and Triton norms / PDL / tinygemm; 0 where
    # the device or the build cannot run them (EngineOptions documents each).
    fused_decode_max_bs: int = 0
    pdl_max_bs: int = 0
    small_gemm_max_bs: int = 0
    gemv_max_bs: int = 0
    quantization: str | None = None  # "fp8": weights quantized at load; FP8 checkpoints set it too
    # FP8 layers' GEMM on CUDA (quant/fp8_linear.py): "block" (flashinfer, Hopper) or "scaled_mm"; None
    # on CPU or without FP8.
    fp8_gemm: str | None = None
    kv_cache_dtype: torch.dtype | None = None  # None: the model dtype
    max_batch_size: int = 256
    expert_parallel: bool = False  # MoE layers hold whole experts per rank (EngineOptions)
    load_format: str = "auto"  # "auto": the checkpoint; "dummy": random weights drawn on the device
    lora: LoraConfig | None = None  # None: LoRA off
    # Room another engine on this device takes from the pool's budget when num_pages is None (a draft
    # model's weights and KV pages); set by the runtime that builds both, never by a user.
    pool_share: PoolShare | None = None

    def switches(self) -> dict[str, object]:
        """The engine's ablation switches as plain values, for benchmark result files."""
        return {
            "attention_backend": self.attention_backend,
            "cuda_graph": self.cuda_graph,
            "piecewise_cuda_graph": self.piecewise_cuda_graph,
            "copy_stream": self.copy_stream,
            "fused_kernels": self.fused_kernels,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "piecewise_max_tokens": self.piecewise_max_tokens,
            "fused_decode_max_bs": self.fused_decode_max_bs,
            "pdl_max_bs": self.pdl_max_bs,
            "small_gemm_max_bs": self.small_gemm_max_bs,
            "gemv_max_bs": self.gemv_max_bs,
            "quantization": self.quantization,
            "fp8_gemm": self.fp8_gemm,
            "kv_cache_dtype": None
            if self.kv_cache_dtype is None
            else str(self.kv_cache_dtype).removeprefix("torch."),
            "lora": None if self.lora is None else dataclasses.asdict(self.lora),
            "page_size": self.page_size,
            "expert_parallel": self.expert_parallel,
            "load_format": self.load_format,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _importable(name: str, attribute: str | None = None) -> bool:
    """Whether module `name` imports (and has `attribute`, if given)."""
    try:
        module = importlib.import_module(name)
    except Exception:  # an incomplete install fails with anything, not only ImportError
        return False
    return attribute is None or hasattr(module, attribute)


def fp8_block_gemm_buildable() -> bool:
    """Whether flashinfer's SM90 block-scaled FP8 GEMM imports and is built or can be built. An install
    stripped of that module's CUDA sources (seen on a device bundle) imports it fine and then fails at
    the first FP8 layer's JIT build; there, FP8 layers take torch's scaled_mm instead."""
    if not _importable("flashinfer.gemm", "fp8_blockscale_gemm_sm90"):
        return False
    try:
        from flashinfer.jit.gemm.fp8_blockscale import gen_fp8_blockscale_gemm_sm90_module

        spec = gen_fp8_blockscale_gemm_sm90_module()
        sources = [Path(source) for source in spec.sources]
        return bool(spec.is_compiled) or all(source.exists() for source in sources)
    except Exception:  # another flashinfer's internals: leave it to the first use, as before
        return True


def _fp8_gemm(quantization: str | None, facts: DeviceFacts) -> str | None:
    """Which library GEMM FP8 layers run (quant/fp8_linear.py); None on CPU or without FP8."""
    if quantization is None or not facts.cuda:
        return None
    return "block" if facts.fp8_block_gemm else "scaled_mm"


def _flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # an incomplete install fails with anything, not only ImportError
        warnings.warn(f"flashinfer is unavailable ({exc!r}); using the torch attention backend", stacklevel=3)
        return False
    return True


def resolve_backend(
    name: str,
    device: torch.device,
    head_dim: int | None = None,
    facts: DeviceFacts | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """'auto' is flashinfer on CUDA when it imports and serves the head size and the dtype (16-bit),
    else the torch reference."""
    on_gpu = device.type == "cuda"
    if name == "flashinfer" and not on_gpu:
        raise ValueError("attention_backend='flashinfer' needs a CUDA device")
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    if name == "flashinfer" and not sixteen_bit:
        raise ValueError(f"attention_backend='flashinfer' serves bfloat16 and float16, got {dtype}")
    served = head_dim is None or head_dim in (*FLASHINFER_HEAD_DIMS, FLASHINFER_MLA_LATENT_DIM)
    if name == "flashinfer" and not served:
        raise ValueError(
            f"attention_backend='flashinfer' serves head_dim {FLASHINFER_HEAD_DIMS}, got {head_dim}"
        )
    if name == "auto":
        # The tiny test models and the demo model (head_dim 16 and 32) take the torch backend on GPU too.
        if not (on_gpu and served and sixteen_bit):
            return "torch"
        importable = facts.flashinfer if facts is not None else _flashinfer_importable()
        return "flashinfer" if importable else "torch"
    if name not in ("torch", "flashinfer"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'flashinfer', got {name!r}")
    return name


def _head_dim(model_dir: Path) -> int | None:
    """The head size attention kernels see: under latent attention the latent's (kv_c and k_pe)."""
    try:
        config = ModelConfig.from_dir(model_dir)
        return config.head_dim if config.mla is None else config.mla.latent_dim
    except (FileNotFoundError, ValueError, KeyError):
        return None  # the engine reports a broken model directory properly when it loads it


def resolve_engine_config(
    model_dir: Path,
    options: EngineOptions | None = None,
    *,
    facts: DeviceFacts | None = None,
    **overrides: Any,
) -> EngineConfig:
    """`options` (or the defaults) with `overrides` (EngineOptions fields) applied, resolved against
    `facts` (probed from the options' device when None; a test states a device it does not have)."""
    opts = dataclasses.replace(options or EngineOptions(), **overrides)
    kv_dtype = torch.float8_e4m3fn if opts.kv_cache_dtype == "fp8_e4m3" else None
    # An FP8 checkpoint is FP8 whatever was asked (an unsupported quantization fails here, by name).
    quantization = "fp8" if Fp8Checkpoint.from_dir(model_dir) is not None else opts.quantization
    if facts is None:
        dev = resolve_device(opts.device)
        facts = DeviceFacts.probe(dev)
    else:
        dev = torch.device("cuda" if facts.cuda else "cpu")
    on_gpu = facts.cuda
    dtype = resolve_dtype(opts.dtype, dev)
    head_dim = _head_dim(model_dir) if on_gpu else None
    backend = resolve_backend(opts.attention_backend, dev, head_dim, facts, dtype)
    # flashinfer and CUDA graphs like 16-token pages; on CPU small pages keep tiny pools fine-grained.
    page = opts.page_size or (16 if on_gpu else 4)
    num_pages = opts.num_pages
    if num_pages is None and not on_gpu:
        num_pages = max(1, KV_TOKENS_CPU // page)
    # Decode graphs need an attention backend that plans into fixed buffers (flashinfer).
    graphs = opts.cuda_graph and on_gpu and backend == "flashinfer"
    # Same condition as the backend: flashinfer imports and serves the head size and the dtype (its
    # kernels take 16-bit tensors, so a float32 run on CUDA, a reference run, keeps the torch path).
    fused = opts.fused_kernels and backend == "flashinfer"
    triton = fused and facts.triton
    # PDL and tinygemm live inside CUDA graphs, with the fused kernels, on Hopper and later; the one-launch
    # decode inside decode graphs, with Triton. PDL only for the Triton kernels' rows.
    hopper_graphs = graphs and fused and facts.hopper
    pdl_rows = min(opts.pdl_max_bs, opts.fused_decode_max_bs) if hopper_graphs else 0
    return EngineConfig(
        model_dir=model_dir,
        device=dev,
        dtype=dtype,
        page_size=page,
        num_pages=num_pages,
        mem_fraction=opts.mem_fraction,
        attention_backend=backend,
        cuda_graph=graphs,
        piecewise_cuda_graph=opts.piecewise_cuda_graph and on_gpu,
        copy_stream=opts.copy_stream and on_gpu,
        fused_kernels=fused,
        triton=triton,
        cuda_graph_max_bs=opts.cuda_graph_max_bs,
        piecewise_max_tokens=opts.piecewise_max_tokens,
        fused_decode_max_bs=opts.fused_decode_max_bs if graphs and triton else 0,
        pdl_max_bs=pdl_rows,
        small_gemm_max_bs=opts.small_gemm_max_bs if hopper_graphs and facts.tinygemm else 0,
        # The GEMV wins by loading its weights under the kernel before it: only where PDL runs.
        gemv_max_bs=min(opts.gemv_max_bs, pdl_rows) if triton else 0,
        quantization=quantization,
        fp8_gemm=_fp8_gemm(quantization, facts),
        kv_cache_dtype=kv_dtype,
        expert_parallel=opts.enable_expert_parallel,
        load_format=opts.load_format,
        lora=_lora(opts, facts),
    )


def _lora(opts: EngineOptions, facts: DeviceFacts) -> LoraConfig | None:
    if not opts.enable_lora:
        return None
    kernels = "triton" if facts.cuda and facts.triton else "torch"
    return LoraConfig(opts.max_loras, opts.max_lora_rank, kernels)
