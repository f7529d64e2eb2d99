"""The persistent softmax kernels behind the op (``settings.persistent``, experimental, off): which
calls take them, and what the op returns with them (outputs and every gradient against the
reference), in eager calls, rotary self-attention and under ``torch.compile``.

CPU tier: Triton's interpreter. GPU tier (``-m gpu``): gem_base's rotary self-attention at the
flagship's lengths, against the op's default kernels.
"""

from __future__ import annotations

import pytest
import torch

from gem.models.sequence import rotary_tables
from kernels.jagged_attention import jagged_attention, rotary_self_attention, testing
from kernels.jagged_attention.call import AttentionCall, Operands, choose_backward, choose_forward
from kernels.jagged_attention.inputs import make_inputs
from kernels.jagged_attention.settings import KernelSettings

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _run(inputs, grad_out, backend="triton", **options):
    """Output and dQ, dK, dV of one call, and the kernels it launched."""
    q, k, v = (t.detach().requires_grad_() for t in inputs.tensors())
    with testing.record_paths() as paths:
        out = jagged_attention(q, k, v, *inputs.args()[3:], backend=backend, **options)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return (out, *grads), list(paths)


@pytest.mark.parametrize("store_ds, dq_kernel", [(True, "dq_from_ds"), (False, "dq")])
def test_softmax_without_a_mask_runs_the_persistent_kernels(store_ds, dq_kernel):
    """Different query and key lengths, an example without keys and one without queries."""
    inputs = make_inputs([5, 0, 40, 1, 17], [7, 3, 12, 0, 40], num_heads=2, head_dim=32, device=DEVICE)
    grad_out = torch.randn_like(inputs.q)
    with testing.override(persistent=True, store_ds=store_ds):
        got, paths = _run(inputs, grad_out, scale=0.2)
    want, _ = _run(inputs, grad_out, backend="reference", scale=0.2)
    assert paths == ["persistent_fwd", "persistent_dkdv", dq_kernel]
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert _relative_error(x, ref) < 1e-5, name


@pytest.mark.parametrize("options", [{"causal": True}, {"activation": "silu"}, {"window": 3}])
def test_other_calls_keep_their_kernels(options):
    inputs = make_inputs([6, 9], num_heads=1, head_dim=16, device=DEVICE)
    with testing.override(persistent=True):
        _, paths = _run(inputs, torch.randn_like(inputs.q), **options)
    assert not any(p.startswith("persistent") for p in paths)


def test_the_choice_reads_the_setting():
    inputs = make_inputs([6, 9], num_heads=1, head_dim=16)

    def chosen(activation="softmax", causal=False, persistent=True):
        call = AttentionCall(9, 9, activation, 0.25, causal=causal, settings=KernelSettings(persistent=persistent))
        operands = Operands.of(*inputs.tensors(), inputs.kv_offsets, call)
        return choose_forward(call, operands), choose_backward(call, operands).dkdv

    assert chosen() == ("persistent", "persistent")
    assert chosen(persistent=False) == ("triton", "triton")
    assert chosen(causal=True) == ("triton", "triton")
    assert chosen(activation="gelu") == ("triton", "triton")
    assert KernelSettings().persistent is False  # off until it passes the GPU gate


def _rotary_inputs(lengths, num_heads, head_dim, dtype, seed=0):
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    total = int(offsets[-1])
    qkv = torch.randn(total, 3, num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    cos, sin = (t.view(total, head_dim // 2) for t in rotary_tables(offsets, total, head_dim))
    return qkv.to(DEVICE, dtype), cos, sin, offsets, max(lengths)


def _rotary(qkv, cos, sin, offsets, max_len, grad_out, backend="triton", compile=False):
    qkv = qkv.detach().requires_grad_()

    def attention(qkv):
        return rotary_self_attention(qkv, cos, sin, offsets, max_len, backend=backend)

    if compile:
        attention = torch.compile(attention, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    with testing.record_paths() as paths:
        out = attention(qkv)
        (grad,) = torch.autograd.grad(out, qkv, grad_out)
    return out, grad, list(paths)


@pytest.mark.parametrize("fused", [True, False])
def test_rotary_self_attention(fused):
    """Fused: dQ and dK turned back through the rotation as the kernels store them, d qkv written
    whole; else the rotary kernel, then the op."""
    qkv, cos, sin, offsets, max_len = _rotary_inputs([5, 0, 21, 1], 2, 32, torch.float32)
    grad_out = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE)
    with testing.override(persistent=True, rotary_fused=fused):
        out, grad, paths = _rotary(qkv, cos, sin, offsets, max_len, grad_out)
    want, want_grad, _ = _rotary(qkv, cos, sin, offsets, max_len, grad_out, backend="reference")
    assert paths == ["persistent_fwd", "persistent_dkdv", "dq_from_ds"]
    assert _relative_error(out, want) < 1e-5
    for part in range(3):
        assert _relative_error(grad[:, part], want_grad[:, part]) < 1e-5, part


def test_torch_compile_fullgraph():
    """No graph break (fullgraph=True raises on one), the same output and gradient as eager.
    CPU: aot_eager; CUDA: Inductor."""
    qkv, cos, sin, offsets, max_len = _rotary_inputs([7, 0, 19], 2, 16, torch.float32, seed=1)
    grad_out = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE)
    with testing.override(persistent=True, rotary_fused=True):
        out, grad, paths = _rotary(qkv, cos, sin, offsets, max_len, grad_out, compile=True)
        want, want_grad, _ = _rotary(qkv, cos, sin, offsets, max_len, grad_out)
    assert "persistent_fwd" in paths and "persistent_dkdv" in paths
    assert _relative_error(out, want) < 1e-5 and _relative_error(grad, want_grad) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flagship_lengths_rotary_compiled():
    """gem_base's rotary self-attention (4 heads of 128, bf16, fused) at the flagship's lengths under
    Inductor, against the op's default kernels."""
    from benchmarks.attention import flagship_lengths

    lengths = flagship_lengths()[:256].tolist()
    qkv, cos, sin, offsets, max_len = _rotary_inputs(lengths, 4, 128, torch.bfloat16)
    grad_out = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE, dtype=qkv.dtype)
    with testing.override(rotary_fused=True):
        want, want_grad, _ = _rotary(qkv, cos, sin, offsets, max_len, grad_out)
        with testing.override(persistent=True):
            out, grad, paths = _rotary(qkv, cos, sin, offsets, max_len, grad_out, compile=True)
    assert "persistent_fwd" in paths and "persistent_dkdv" in paths  # (the launchers, as Inductor traced them)
    assert _relative_error(out, want) < 1e-2 and _relative_error(grad, want_grad) < 1e-2
