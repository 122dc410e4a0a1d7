"""Multi-LoRA: PEFT adapters read and checked against the base model, GPU slots of fixed buffers that the
column- and row-parallel layers read per row, the per-batch row-to-slot metadata, and the batched kernels
(Triton on CUDA, a gathered torch reference elsewhere)."""
