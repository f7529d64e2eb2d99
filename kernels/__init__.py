"""gem kernels: Triton kernels with plain PyTorch references. Depends on torch and triton only."""

from kernels.jagged_attention import jagged_attention

__all__ = ["jagged_attention"]
