"""kernels.generated_weights: the personalized FFN's per-example weights, the Triton kernels
(forward and the three gradients) against float64 autograd of the formula.

CPU tier: Triton's interpreter at small shapes that cover every mask (N, C and the batch not
multiples of the blocks). GPU tier (``-m gpu``): gem_base's shapes, eager and under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from kernels.generated_weights import generated_weights

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _inputs(num_seqs, num_kv, num_summary, width, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(num_kv, width, generator=gen).to(device)
    mix = torch.randn(num_kv, num_summary, generator=gen).to(device)
    generated = torch.randn(num_seqs, num_summary, width, generator=gen).to(device, dtype)
    return shared, mix, generated


def _check(shared, mix, generated, tol, backend="triton", fn=generated_weights):
    """The output and the gradients of a random linear loss against float64 autograd of the
    formula on the same (rounded) inputs; relative errors in norm, each in its input's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (shared, mix, generated)]
    out = fn(*leaves, backend=backend)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    grads = torch.autograd.grad((weights * out.float()).sum(), leaves)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    want = exact[0] + torch.einsum("ns,bsc->bnc", exact[1], exact[2])
    want_grads = torch.autograd.grad((weights.double() * want).sum(), exact)
    assert out.dtype == generated.dtype and out.shape == want.shape
    names = ["out", "shared", "mix", "generated"]
    for name, got, ref, leaf in zip(names, [out, *grads], [want, *want_grads], [out, *leaves]):
        assert got.dtype == leaf.dtype, name
        assert (got.double() - ref).norm() <= tol * ref.norm(), name
    return out, grads


@pytest.mark.parametrize("shape", [(5, 7, 3, 20), (33, 130, 4, 70), (1, 1, 1, 1)])  # (B, N, S, C)
def test_matches_float64_fp32(shape):
    """float32 throughout: the kernels' float32 sums against float64 (the batch sums of ``shared``
    and ``mix`` run over groups of 32 examples, then over the groups)."""
    inputs = _inputs(*shape, torch.float32)
    _check(*inputs, 1e-6)
    _check(*inputs, 1e-6, backend="reference")


def test_bf16_generated_rounds_once():
    """bf16 ``generated`` (the autocast projection's output): the product in float32, the output
    rounded once to bf16; ``shared`` and ``mix`` (float32 parameters) get float32 gradients."""
    shared, mix, generated = _inputs(9, 20, 4, 24, torch.bfloat16)
    out, _ = _check(shared, mix, generated, 1e-2)
    exact = shared.double() + torch.einsum("ns,bsc->bnc", mix.double(), generated.double())
    # within a bf16 ulp of the exact value (the interpreter truncates where a GPU rounds to nearest)
    assert ((out.double() - exact).abs() <= 2**-7 * 1.001 * exact.abs()).all()


def test_strided_slices_as_the_personalized_ffn_passes_them():
    """The PFFN passes K's and V's halves: ``shared[:, part]`` and ``generated[..., part]``."""
    shared, mix, generated = _inputs(6, 10, 4, 32, torch.float32)
    for part in (slice(0, 16), slice(16, None)):
        _check(shared[:, part], mix, generated[..., part], 1e-6)
    _check(shared, mix.t().contiguous().t(), generated, 1e-6)  # a column-major mix


def test_empty_batch():
    shared, mix, generated = _inputs(0, 10, 4, 8, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (shared, mix, generated)]
    out = generated_weights(*leaves, backend="triton")
    assert out.shape == (0, 10, 8)
    out.sum().backward()
    assert torch.equal(leaves[0].grad, torch.zeros_like(shared)) and torch.equal(leaves[1].grad, torch.zeros_like(mix))


def test_bad_input_names_the_argument():
    shared, mix, generated = _inputs(2, 10, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"generated must be \[B, S, C\] = \[B, 4, 8\]"):
        generated_weights(shared, mix, generated[..., :6])
    with pytest.raises(ValueError, match="mix has 9 rows, shared 10"):
        generated_weights(shared, mix[:9], generated)
    with pytest.raises(ValueError, match=r"expected shared \[N, C\]"):
        generated_weights(shared[None], mix, generated)
    with pytest.raises(ValueError, match="backend='cuda'"):
        generated_weights(shared, mix, generated, backend="cuda")


def test_compiled_matches_eager():
    """Under torch.compile (Inductor launches the kernels on a GPU; the interpreter runs them as an
    opaque op on the CPU) the results equal the eager call's bit for bit."""
    inputs = _inputs(7, 12, 4, 16, torch.float32)
    eager = _check(*inputs, 1e-6)
    torch._dynamo.reset()
    compiled = _check(*inputs, 1e-6, fn=torch.compile(generated_weights, fullgraph=True))
    for a, b in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):
        assert torch.equal(a, b)


@gpu
@requires_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_gem_base_shapes(compiled):
    """gem_base's personalized FFN: 1,024 examples, N = 256 K/V rows, S = 4 summary tokens, one
    half (K or V) of the 1,024 generated columns, bf16; eager and under torch.compile."""
    shared, mix, generated = _inputs(1024, 256, 4, 1024, torch.bfloat16)
    fn = generated_weights
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(generated_weights, fullgraph=True)
    _check(shared[:, :512], mix, generated[..., 512:], 1e-2, fn=fn)


def test_personalized_ffn_on_the_kernels_matches_its_reference():
    """gem's personalized FFN with the Triton backend (its K/V from these kernels, its GDPA call on
    the attention kernels) against the same module on the PyTorch reference: output and every
    parameter's gradient."""
    from gem.models.sequence import PersonalizedFFN

    torch.manual_seed(0)
    modules = {backend: PersonalizedFFN(16, 2, 8, 3, 5, backend=backend) for backend in ("triton", "reference")}
    for p in modules["triton"].parameters():
        torch.nn.init.normal_(p, std=0.5)
    modules["reference"].load_state_dict(modules["triton"].state_dict())
    offsets = torch.tensor([0, 4, 4, 11])
    x, summary = torch.randn(11, 16), torch.randn(3, 3, 8)
    results = {}
    for backend, module in modules.items():
        out = module(x, offsets, 7, summary)
        out.square().sum().backward()
        results[backend] = [out.detach(), *(p.grad for p in module.parameters())]
    names = ["out", *(n for n, _ in modules["triton"].named_parameters())]
    for name, got, want in zip(names, results["triton"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
