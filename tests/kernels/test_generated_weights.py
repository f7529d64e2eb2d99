"""kernels.generated_weights: the gradients of the personalized FFN's per-example weights from one
read of the gradient, against float64 autograd of the formula; and gem's compiled
``generate_weights``, whose backward takes the kernel with the Triton backend.

CPU tier: Triton's interpreter at small shapes that cover every mask (N, C and the batch not
multiples of the blocks). GPU tier (``-m gpu``): gem_base's shapes, eager and under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from gem.models.sequence import generate_weights
from kernels.generated_weights import generated_weights_backward
from kernels.jagged_attention.testing import override

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _inputs(num_seqs, num_kv, num_summary, width, dtype, device=DEVICE, seed=0):
    """shared, mix (float32 parameters), generated and a gradient of the output (``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(num_kv, width, generator=gen).to(device)
    mix = torch.randn(num_kv, num_summary, generator=gen).to(device)
    generated = torch.randn(num_seqs, num_summary, width, generator=gen).to(device, dtype)
    grad = torch.randn(num_seqs, num_kv, width, generator=gen).to(device, dtype)
    return shared, mix, generated, grad


def _exact(shared, mix, generated, grad):
    """float64 autograd of ``shared + mix @ generated[b]`` (mix rounded to grad's dtype for
    ``generated``'s gradient, as the kernel and the GEMM it replaces take it)."""
    leaves = [t.double().requires_grad_() for t in (shared, mix, generated)]
    out = leaves[0] + torch.einsum("ns,bsc->bnc", leaves[1], leaves[2])
    d_shared, d_mix, _ = torch.autograd.grad(out, leaves, grad.double())
    d_gen = torch.einsum("ns,bnc->bsc", mix.to(grad.dtype).double(), grad.double())
    return d_shared, d_mix, d_gen


def _close(got, want, tol):
    for name, a, b in zip(["shared", "mix", "generated"], got, want):
        assert (a.double() - b).norm() <= tol * b.norm(), name


@pytest.mark.parametrize("shape", [(5, 7, 3, 20), (70, 130, 4, 70), (3, 300, 2, 24), (1, 1, 1, 1)])  # (B, N, S, C)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_matches_float64_fp32(shape, backend):
    """float32 throughout (the kernel's products IEEE, not tf32), to float32 sums' rounding; 70
    examples: three groups of 32, the last one partial; 130 rows and 70 columns: masked blocks;
    300 rows: two blocks of 256 (gem_large's 512), whose partial sums of ``d_gen`` are added."""
    shared, mix, generated, grad = _inputs(*shape, torch.float32)
    got = generated_weights_backward(grad, mix, generated, backend=backend)
    assert [t.dtype for t in got] == [torch.float32] * 3
    assert [t.shape for t in got] == [shared.shape, mix.shape, generated.shape]
    _close(got, _exact(shared, mix, generated, grad), 1e-5)


def test_bf16_gradient():
    """bf16 gradient and ``generated`` (autocast's): products on bf16 inputs (exact in float32),
    float32 sums; ``d_gen`` rounded once to bf16, ``d_shared`` and ``d_mix`` float32."""
    shared, mix, generated, grad = _inputs(40, 20, 4, 24, torch.bfloat16)
    got = generated_weights_backward(grad, mix, generated, backend="triton")
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.bfloat16]
    _close(got, _exact(shared, mix, generated, grad), 1e-2)
    d_shared, d_mix, _ = _exact(shared, mix, generated, grad)
    torch.testing.assert_close(got[0].double(), d_shared, rtol=1e-5, atol=1e-5)  # float32 sums of bf16 values
    torch.testing.assert_close(got[1].double(), d_mix, rtol=1e-5, atol=1e-4)


def test_strided_inputs_as_the_personalized_ffn_passes_them():
    """``generated[..., part]`` (K's and V's halves of one projection) and a strided gradient."""
    shared, mix, generated, grad = _inputs(6, 10, 4, 32, torch.float32)
    wide_grad = torch.randn(6, 10, 48)
    wide_grad[..., :16] = grad[..., :16]
    for part, g in ((slice(0, 16), wide_grad[..., :16]), (slice(16, None), grad[..., 16:])):
        got = generated_weights_backward(g, mix, generated[..., part], backend="triton")
        _close(got, _exact(shared[:, part], mix, generated[..., part], g), 1e-6)


def test_empty_batch():
    shared, mix, generated, grad = _inputs(0, 10, 4, 8, torch.float32)
    d_shared, d_mix, d_gen = generated_weights_backward(grad, mix, generated, backend="triton")
    assert torch.equal(d_shared, torch.zeros(10, 8)) and torch.equal(d_mix, torch.zeros(10, 4))
    assert d_gen.shape == (0, 4, 8)


def test_bad_input_names_the_argument():
    _, mix, generated, grad = _inputs(2, 10, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"mix must be \[N, S\] and generated \[B, S, C\]"):
        generated_weights_backward(grad, mix, generated[..., :6])
    with pytest.raises(ValueError, match=r"expected grad \[B, N, C\]"):
        generated_weights_backward(grad[0], mix, generated)
    with pytest.raises(ValueError, match="backend='cuda'"):
        generated_weights_backward(grad, mix, generated, backend="cuda")


def _compiled_gradients(backend, inputs):
    shared, mix, generated, grad = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (shared, mix, generated)]
    torch._dynamo.reset()
    out = torch.compile(generate_weights, fullgraph=True)(*leaves, backend=backend)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def test_compiled_generate_weights_takes_the_kernel_with_the_triton_backend(monkeypatch):
    """gem's compiled ``generate_weights``: its backward calls the kernel with the Triton backend
    (counted here through the op's launcher) and the three GEMM-and-sum gradients otherwise; both
    give the float64 gradients, in the parameters' and ``generated``'s dtypes."""
    import kernels.generated_weights as gw

    launched = []
    launcher = gw._backward
    monkeypatch.setattr(gw, "_backward", lambda *args, **kwargs: launched.append(1) or launcher(*args, **kwargs))
    inputs = _inputs(9, 12, 4, 16, torch.float32)
    want = _exact(*inputs)
    for backend, calls in (("reference", 0), ("triton", 1)):
        out, grads = _compiled_gradients(backend, inputs)
        assert len(launched) == calls, backend
        assert [g.dtype for g in grads] == [torch.float32] * 3
        _close(grads, want, 1e-6)
    with override(generated_weights=False):  # the kernels' switch turns the kernel off
        _, grads = _compiled_gradients("triton", inputs)
    assert len(launched) == 1
    _close(grads, want, 1e-6)


@gpu
@requires_cuda
def test_gpu_gem_base_shapes():
    """gem_base's personalized FFN: 1,024 examples, N = 256 K/V rows, S = 4 summary tokens, K's
    half (512 columns) of the generated projection, bf16; the kernel alone and in the compiled
    ``generate_weights``, against float64 and against the GEMM path."""
    shared, mix, generated, grad = _inputs(1024, 256, 4, 1024, torch.bfloat16)
    inputs = (shared[:, :512], mix, generated[..., :512], grad[..., :512].contiguous())
    want = _exact(*inputs)
    _close(generated_weights_backward(inputs[3], mix, inputs[2]), want, 1e-2)
    kernel_out, kernel_grads = _compiled_gradients("triton", inputs)
    gemm_out, gemm_grads = _compiled_gradients("reference", inputs)
    assert torch.equal(kernel_out, gemm_out)
    _close(kernel_grads, want, 1e-2)
    _close(gemm_grads, want, 1e-2)
