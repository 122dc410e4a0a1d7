"""Mixture-of-experts: one MoE layer (router, top-k, experts, optional shared expert), its expert weights
sharded for tensor or expert parallelism, and its fused Triton kernels."""
