"""kernels.rotary: the Triton rotary kernels (forward and gradient) against the PyTorch reference.

CPU tier: Triton's interpreter at small shapes. GPU tier (``-m gpu``): gem_base's shapes, eager
and under torch.compile (Inductor launches the kernels).
"""

from __future__ import annotations

import pytest
import torch

from gem.models.sequence import rotary_tables
from kernels.rotary import rotary_qkv

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _inputs(lengths, num_heads, head_dim, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    total = int(offsets[-1])
    qkv = torch.randn(total, 3, num_heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
    cos, sin = (t.view(total, head_dim // 2) for t in rotary_tables(offsets, total, head_dim))
    return qkv, cos, sin


def _check(qkv, cos, sin, tol):
    """Triton vs the reference on the same inputs, relative errors in norm: outputs, then the
    gradient of a random loss."""
    grads = [torch.randn(qkv.shape[0], *qkv.shape[2:], dtype=qkv.dtype, device=qkv.device) for _ in range(3)]
    results = []
    for backend in ("triton", "reference"):
        qkv.grad = None
        out = rotary_qkv(qkv, cos, sin, backend=backend)
        torch.autograd.backward(out, grads)
        results.append(([o.detach().float() for o in out], qkv.grad.float()))
    (out, grad), (ref, ref_grad) = results
    for name, a, b in zip("qkv", out, ref):
        assert (a - b).norm() <= tol * b.norm(), name
    assert (grad - ref_grad).norm() <= tol * ref_grad.norm()
    return out, grad


@pytest.mark.parametrize("head_dim", [8, 12])  # 12: half 6, a masked block of 8
@pytest.mark.parametrize("lengths", [[5, 0, 13], [1], [0, 0]])
def test_matches_reference_fp32(lengths, head_dim):
    qkv, cos, sin = _inputs(lengths, 2, head_dim, torch.float32)
    _check(qkv, cos, sin, 1e-6)


def test_matches_reference_bf16_and_rotation_is_orthogonal():
    """bf16: the kernel rounds once (float32 math), the reference after every operation. The
    backward is the transpose of the forward's rotation: rotating dQ back recovers it."""
    qkv, cos, sin = _inputs([7, 20], 3, 16, torch.bfloat16)
    _check(qkv, cos, sin, 1e-2)
    x = torch.randn(27, 3, 3, 16)
    q, k, v = rotary_qkv(x, cos, sin, backend="triton")
    assert torch.equal(v, x[:, 2])
    assert torch.allclose(q.norm(dim=-1), x[:, 0].norm(dim=-1), atol=1e-5)  # a rotation keeps norms


def test_strided_input_and_rotation_by_position():
    """A strided qkv (a slice of a wider projection); each channel pair (j, j + D/2), read as the
    complex number x_j + i x_{j+D/2}, turns by position * 10000^(-j / (D/2)) radians."""
    lengths, head_dim = [9, 4], 8
    qkv, cos, sin = _inputs(lengths, 2, head_dim, torch.float32)
    wide = torch.randn(13, 4, 2, head_dim)
    wide[:, :3] = qkv.detach()
    q, k, v = rotary_qkv(wide[:, :3], cos, sin, backend="triton")
    positions = torch.cat([torch.arange(n) for n in lengths]).float()
    angles = positions[:, None] * 10000.0 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [T, 1, D/2]
    for got, x in ((q, qkv[:, 0]), (k, qkv[:, 1])):
        x = x.detach()
        z = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :]) * turn
        assert torch.allclose(got, torch.cat([z.real, z.imag], dim=-1), atol=1e-5)
    assert torch.equal(v, qkv[:, 2].detach())


def test_bad_input_is_named():
    qkv, cos, sin = _inputs([3], 1, 8, torch.float32)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 3, H, D\]"):
        rotary_qkv(qkv[:, :2], cos, sin)
    with pytest.raises(ValueError, match=r"cos must be \[T, D/2\] = \[3, 4\]"):
        rotary_qkv(qkv, cos[:, :2], sin)
    with pytest.raises(ValueError, match="sin must be float32"):
        rotary_qkv(qkv, cos, sin.double())
    with pytest.raises(ValueError, match="head dim 7 must be even"):
        rotary_qkv(torch.zeros(3, 3, 1, 7), cos, sin)
    with pytest.raises(ValueError, match="backend='cuda'"):
        rotary_qkv(qkv, cos, sin, backend="cuda")


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [128, 96])
def test_gpu_gem_base_shapes_eager_and_compiled(head_dim):
    """gem_base's stream (4 heads, histories up to 512 rows) in bf16, eager and compiled."""
    lengths = torch.randint(0, 516, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    qkv, cos, sin = _inputs(lengths, 4, head_dim, torch.bfloat16, device="cuda")
    out, grad = _check(qkv, cos, sin, 2e-2)

    def layer(x):
        q, k, v = rotary_qkv(x * 1.0, cos, sin)
        return q, k, v

    compiled = torch.compile(layer, fullgraph=True)
    grads = [torch.randn_like(o) for o in out]
    qkv.grad = None
    torch.autograd.backward(compiled(qkv), [g.to(qkv.dtype) for g in grads])
    compiled_grad = qkv.grad.float()
    qkv.grad = None
    torch.autograd.backward(rotary_qkv(qkv, cos, sin, backend="triton"), [g.to(qkv.dtype) for g in grads])
    assert torch.equal(compiled_grad, qkv.grad.float())
