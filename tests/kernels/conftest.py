"""Kernel tests: without CUDA, Triton kernels run in its interpreter (TRITON_INTERPRET=1).

The variable must be set before triton is first imported, hence at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
