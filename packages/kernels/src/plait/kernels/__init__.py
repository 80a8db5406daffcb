"""plait.kernels: Fused Triton kernels (SwiGLU, RMSNorm, linear cross-entropy, MoE permutation, stochastic-rounding AdamW, grouped GEMM) and the split-backward switch."""

__all__: list[str] = []
