"""kernels.attention_pooling: the Triton kernels (forward, gradients of the rows and of the queries)
against the PyTorch reference, and the reference against a direct per-example softmax.

CPU tier: Triton's interpreter at small shapes. GPU tier (``-m gpu``): gem_base's shapes, eager
and under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention_pooling import attention_pooling

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _inputs(lengths, dim, cols, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    x = torch.randn(int(offsets[-1]), dim, generator=gen).to(device, dtype).requires_grad_()
    a = (torch.randn(dim, cols, generator=gen) * dim**-0.5).to(device, dtype).requires_grad_()
    return x, a, offsets


def _check(x, a, offsets, max_len, tol):
    """Triton against the reference on the same inputs, relative errors in norm: the output, then
    the gradients of a random loss with respect to the rows and the query columns (an example of
    one row has a zero gradient for the queries, which the kernels leave at their rounding: that
    error is bounded relative to dx's norm)."""
    grad = torch.randn(offsets.numel() - 1, a.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    results = []
    for backend in ("triton", "reference"):
        x.grad = a.grad = None
        out = attention_pooling(x, a, offsets, max_len, backend=backend)
        out.backward(grad)
        results.append((out.detach().float(), x.grad.float(), a.grad.float()))
    floor = results[1][1].norm()  # dx's norm, where the reference's dA is zero (rows of one example)
    for name, got, want in zip(("out", "dx", "da"), *results):
        assert torch.isfinite(got).all(), name
        assert (got - want).norm() <= tol * max(want.norm(), floor), name
    return results[0]


# 40 columns: three query blocks of 16, the last partial; 24 wide: a masked block of 32 columns
@pytest.mark.parametrize("dim, cols", [(16, 3), (24, 40)])
@pytest.mark.parametrize("lengths", [[5, 0, 37], [1], [0, 0], [16, 17]])
def test_matches_reference_fp32(lengths, dim, cols):
    x, a, offsets = _inputs(lengths, dim, cols, torch.float32)
    out, dx, da = _check(x, a, offsets, max(lengths), 1e-5)
    empty = [b for b, n in enumerate(lengths) if n == 0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # no rows: zeros


def test_matches_reference_bf16():
    """bf16: the kernels accumulate in float32 and round once, the reference after every operation."""
    x, a, offsets = _inputs([7, 40, 0, 3], 32, 20, torch.bfloat16)
    _check(x, a, offsets, 40, 2e-2)


def test_reference_is_a_softmax_over_each_examples_rows():
    """The reference against the definition, example by example, in float64; a bound ``max_len``
    larger than the longest example changes nothing."""
    x, a, offsets = _inputs([4, 0, 9], 8, 5, torch.float64, device="cpu")
    out = attention_pooling(x, a, offsets, 12, backend="reference")
    for b in range(3):
        rows = x[offsets[b] : offsets[b + 1]]
        weights = torch.softmax(rows @ a, dim=0)  # [L, Q]
        want = weights.t() @ rows if rows.shape[0] else torch.zeros(5, 8, dtype=torch.float64)
        assert torch.allclose(out[b], want, atol=1e-12)


def test_bad_input_is_named():
    x, a, offsets = _inputs([3], 8, 2, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[T, D\] and a \[D, Q\]"):
        attention_pooling(x, a[:4], offsets, 3)
    with pytest.raises(ValueError, match="dtypes differ"):
        attention_pooling(x, a.double(), offsets, 3)
    with pytest.raises(ValueError, match="offsets must be"):
        attention_pooling(x, a, offsets.float(), 3)
    with pytest.raises(ValueError, match="backend='cuda'"):
        attention_pooling(x, a, offsets, 3, backend="cuda")


@gpu
@requires_cuda
@pytest.mark.parametrize("cols", [16, 128])  # InterFormer's PMA (4 queries x 4 heads), Kunlun's seeds (32 x 4)
def test_gpu_gem_base_shapes_eager_and_compiled(cols):
    """gem_base's rows (width 512, histories up to 512 rows, some empty) in bf16, eager and compiled."""
    lengths = torch.randint(0, 516, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    lengths[3] = 0
    x, a, offsets = _inputs(lengths, 512, cols, torch.bfloat16, device="cuda")
    _check(x, a, offsets, max(lengths), 2e-2)
    grad = torch.randn(len(lengths), cols, 512, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(lambda x, a: attention_pooling(x * 1.0, a, offsets, max(lengths)), fullgraph=True)
    results = []
    for fn in (compiled, lambda x, a: attention_pooling(x, a, offsets, max(lengths))):
        x.grad = a.grad = None
        fn(x, a).backward(grad)
        results.append((x.grad.float(), a.grad.float()))
    for got, want in zip(*results):  # Inductor computes the backward's row sums in its own order
        assert (got - want).norm() <= 1e-2 * want.norm()
