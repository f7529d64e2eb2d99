"""kernels.jagged_attention.generated_kv: GDPA with the personalized FFN's keys and values generated
inside the kernels, forward and backward, against its reference (the generation, then the op's
reference, differentiated by autograd) and against the model's path (``generate_weights``, then
``jagged_attention``).

CPU tier: Triton's interpreter at small shapes whose N, S, D and lengths are not multiples of the
blocks, with empty examples. GPU tier (``-m gpu``): gem_base's personalized FFN shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.jagged_attention import jagged_attention
from kernels.jagged_attention.generated_kv import (
    POINTWISE,
    generated_kv_attention,
    generated_kv_backward,
    generated_kv_forward,
    generated_kv_reference,
)
from kernels.jagged_attention.inputs import generated_kv_inputs

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _inputs(lengths, num_heads, head_dim, num_kv, num_summary, dtype, seed=0):
    return generated_kv_inputs(
        lengths,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv=num_kv,
        num_summary=num_summary,
        dtype=dtype,
        device=DEVICE,
        generator=torch.Generator().manual_seed(seed),
    )


def _error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("activation", POINTWISE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(activation, dtype):
    args = _inputs([5, 0, 17, 1, 70], num_heads=2, head_dim=24, num_kv=37, num_summary=3, dtype=dtype)
    got = generated_kv_forward(*args, activation=activation, block_m=16, block_n=16, num_warps=1, num_stages=1)
    want = generated_kv_reference(*args, activation=activation)
    assert got.shape == want.shape and got.dtype == dtype
    assert _error(got, want) < (1e-5 if dtype == torch.float32 else 2e-2), activation


def test_equals_the_models_generation_then_the_op():
    """The model's path, ``generate_weights`` (eager: float32 baddbmm, rounded to G's dtype) and the
    op on the generated K/V: the same function, scales included (the op's post_scale 1/N)."""
    from gem.models.sequence import generate_weights

    q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v = _inputs(
        [9, 3, 0, 33], num_heads=2, head_dim=16, num_kv=20, num_summary=4, dtype=torch.float32, seed=1
    )
    k, v = (generate_weights(w, mix, g).view(4, 20, 2, 16) for w, g in ((shared_k, gen_k), (shared_v, gen_v)))
    want = jagged_attention(q, k, v, offsets, None, max_len, None, activation="silu", post_scale=1 / 20)
    got = generated_kv_forward(
        q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, block_m=16, block_n=16, num_warps=1, num_stages=1
    )
    assert _error(got, want) < 1e-5


LEAVES = (0, 3, 4, 5, 6, 7)  # q, shared_k, shared_v, mix, gen_k, gen_v of the arguments


def _gradients(fn, args, grad_out, **kwargs):
    """The gradients of ``fn(*args, **kwargs)`` with respect to LEAVES, for ``grad_out``."""
    args = [a.detach().requires_grad_() if i in LEAVES else a for i, a in enumerate(args)]
    return torch.autograd.grad(fn(*args, **kwargs), [args[i] for i in LEAVES], grad_out)


def _norm_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("activation", POINTWISE)
@pytest.mark.parametrize("groups", [1, 2, 9])  # 9: more groups than examples
def test_backward_matches_the_reference(activation, groups):
    """Every gradient in float32, with N, S, D and lengths off the blocks, empty examples, and the
    examples split into one group, two, and more groups than there are examples."""
    args = _inputs([5, 0, 17, 1, 40], num_heads=2, head_dim=24, num_kv=37, num_summary=3, dtype=torch.float32)
    grad_out = torch.randn_like(args[0])
    want = _gradients(generated_kv_reference, args, grad_out, activation=activation)
    config = dict(block_m=16, block_n=16, groups=groups, dq_block_m=16, dq_block_n=16, num_warps=1, dq_num_warps=1)
    got = generated_kv_backward(grad_out, *args, activation=activation, **config)
    for name, g, w in zip(("q", "shared_k", "shared_v", "mix", "gen_k", "gen_v"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _error(g, w) < 1e-5, name


@pytest.mark.parametrize("activation", ["silu", "fast_gelu"])
def test_autograd_in_bf16(activation):
    """generated_kv_attention (the forward and backward through autograd) in bf16, as the model runs
    it, against the reference's gradients on the same inputs (relu's, whose gradient steps at 0,
    are checked in float32 above)."""
    args = _inputs([5, 0, 17, 1, 40], num_heads=2, head_dim=16, num_kv=37, num_summary=4, dtype=torch.bfloat16)
    grad_out = torch.randn_like(args[0])
    want = _gradients(generated_kv_reference, args, grad_out, activation=activation)
    got = _gradients(generated_kv_attention, args, grad_out, activation=activation)
    for name, g, w in zip(("q", "shared_k", "shared_v", "mix", "gen_k", "gen_v"), got, want):
        assert g.dtype == w.dtype and _norm_error(g, w) < 2e-2, name


def test_backward_of_empty_examples_is_zero():
    args = _inputs([0, 0], num_heads=2, head_dim=16, num_kv=8, num_summary=2, dtype=torch.float32)
    for grad in generated_kv_backward(torch.zeros_like(args[0]), *args):
        assert not grad.any()


def test_bad_inputs_name_the_argument():
    args = list(_inputs([3, 4], num_heads=2, head_dim=16, num_kv=8, num_summary=2, dtype=torch.float32))
    with pytest.raises(ValueError, match="generated K/V take a pointwise activation"):
        generated_kv_forward(*args, activation="softmax")
    with pytest.raises(ValueError, match=r"grad_out must be shaped as q \(7, 2, 16\)"):
        generated_kv_backward(args[0][:3], *args)
    args[6] = args[6][:, :1]  # gen_k with one summary row of two
    with pytest.raises(ValueError, match=r"gen_k must be \[B, S, H \* D\] = \(2, 2, 32\), got \(2, 1, 32\)"):
        generated_kv_forward(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_gem_base_shapes():
    """gem_base's personalized FFN: 4 heads of 128, 256 generated rows, 4 summary tokens, bf16."""
    lengths = torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    args = _inputs(lengths, num_heads=4, head_dim=128, num_kv=256, num_summary=4, dtype=torch.bfloat16)
    assert _error(generated_kv_forward(*args), generated_kv_reference(*args)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_gem_base_shapes_backward():
    """The backward at gem_base's personalized FFN shapes in bf16 (the bf16x2 path on sm_90, the
    default launch configs): every gradient against the float64 reference's, within the kernel
    tests' bf16 tolerance (3e-2 in norm)."""
    lengths = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    args = _inputs(lengths, num_heads=4, head_dim=128, num_kv=256, num_summary=4, dtype=torch.bfloat16)
    grad_out = torch.randn_like(args[0])
    exact = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    want = _gradients(generated_kv_reference, exact, grad_out.double())
    got = _gradients(generated_kv_attention, args, grad_out)
    for name, g, w in zip(("q", "shared_k", "shared_v", "mix", "gen_k", "gen_v"), got, want):
        assert torch.isfinite(g).all() and _norm_error(g, w) < 3e-2, name
