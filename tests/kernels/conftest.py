"""Kernel tests (without CUDA, Triton runs in its interpreter: see ../conftest.py)."""

import os

# One default config per kernel keeps the GPU tier's compile time down; the autotuned path
# is covered by test_gpu_autotuned_configs (which sets GEM_KERNELS_AUTOTUNE=1 itself).
os.environ.setdefault("GEM_KERNELS_AUTOTUNE", "0")
