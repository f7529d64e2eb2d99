"""Kernel tests: without CUDA, Triton kernels run in its interpreter (TRITON_INTERPRET=1).

The variable must be set before triton is first imported, hence at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One default config per kernel keeps the GPU tier's compile time down; the autotuned path
# is covered by test_gpu_autotuned_configs (which sets GEM_KERNELS_AUTOTUNE=1 itself).
os.environ.setdefault("GEM_KERNELS_AUTOTUNE", "0")
