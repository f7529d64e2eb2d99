"""Kernel tests (without CUDA, Triton runs in its interpreter: see ../conftest.py)."""

import os

import pytest

from kernels import fallback
from kernels.jagged_attention import testing

# One default config per kernel keeps the GPU tier's compile time down; the autotuned path
# is covered by test_gpu_autotuned_configs (which sets GEM_KERNELS_AUTOTUNE=1 itself).
os.environ.setdefault("GEM_KERNELS_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def no_fallback():
    """Every kernel test runs the Gluon kernels whatever the Triton release (their GPU tests are how
    a release is verified), and fails where any kernel fell back to a slower path: a kernel that
    does not build is a failure here, never a pass on the next path."""
    fallback.clear()
    with testing.unverified_gluon():
        yield
    events = fallback.events()
    fallback.clear()
    assert not events, "kernels fell back: " + "; ".join(event.message() for event in events)
