"""Programmatic dependent launch (PDL) for the Triton kernels of small decode graphs.

Why: at batch 1 a decode step is a chain of ~9 kernels a layer, and most of them are short. With PDL a
kernel's programs may start while the kernel before it in the stream is still running, and wait for it
(`gdc_wait`) only before they read what it wrote. Each of these kernels also lets the next one start at
once (`gdc_launch_dependents`), so a GEMM that follows with PDL (flashinfer's tinygemm) streams its
weights in while the small kernel runs.

The rules every kernel launched this way keeps, so that any chain of them is safe:
- before its wait it reads only constants (weights, rope tables) and what was written before the CUDA
  graph started (page tables, earlier tokens' K/V), never an earlier kernel's output in the same graph;
- it writes nothing before its wait: a kernel launched early may still be reading;
- every program waits, even one with nothing to do, so the wait's completion covers the whole chain.

Only on CUDA devices of compute capability 9.0 and later; the caller decides (`FusedKernels`).
"""

from __future__ import annotations


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch keywords of a Triton kernel that takes the constexpr `PDL`: with PDL, Triton launches it
    with the programmatic-serialization attribute (a graph captures it as a programmatic edge)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
