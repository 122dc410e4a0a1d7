"""Weight and KV-cache quantization: FP8 checkpoints, dynamic FP8 and the FP8 GEMM."""
