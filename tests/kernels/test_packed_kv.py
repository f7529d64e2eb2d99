"""kernels.jagged_attention.packed_kv_attention: broadcast queries over a packed K/V projection,
whose dK/dV kernel writes the gradient of ``kv`` whole, against the reference and against
jagged_attention on the two halves (the same kernels, so the same numbers).

CPU tier: Triton's interpreter at small shapes. GPU tier (``-m gpu``): Kunlun's seed pooling at
gem_base's shapes, eager and under torch.compile (Inductor launches the kernels).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels.jagged_attention import jagged_attention, num_visible_pairs, packed_kv_attention, testing

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _inputs(lengths, num_queries, num_heads, head_dim, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    q = torch.randn(num_queries, num_heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
    kv = torch.randn(int(offsets[-1]), 2, num_heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
    return q, kv, offsets


def _run(q, kv, offsets, grad, call):
    """Output, dQ and d kv of ``call(q, kv)`` under the loss ``(out * grad).sum()``."""
    q.grad = kv.grad = None
    out = call(q, kv)
    out.backward(grad)
    return out.detach().float(), q.grad.float(), kv.grad.float()


def _two_tensors(offsets, max_len, backend):
    return lambda q, kv: jagged_attention(q, kv[:, 0], kv[:, 1], None, offsets, None, max_len, backend=backend)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_matches_reference_and_the_two_tensor_call(head_dim):
    """float32 against the reference (output, dQ, both halves of d kv; an example without rows
    pools to zeros), and bit for bit against jagged_attention on the halves, the same kernels
    writing dK and dV into separate tensors."""
    lengths = [5, 0, 13, 1]
    q, kv, offsets = _inputs(lengths, 3, 2, head_dim, torch.float32)
    grad = torch.randn(len(lengths), *q.shape, device=DEVICE)
    with testing.record_paths() as paths:
        out, dq, dkv = _run(
            q, kv, offsets, grad, lambda q, kv: packed_kv_attention(q, kv, offsets, 13, backend="triton")
        )
    assert list(paths) == ["triton_fwd", "triton_dkdv", "dq"]
    ref = _run(q, kv, offsets, grad, lambda q, kv: packed_kv_attention(q, kv, offsets, 13, backend="reference"))
    for got, want in zip((out, dq, dkv[:, 0], dkv[:, 1]), (ref[0], ref[1], ref[2][:, 0], ref[2][:, 1])):
        assert (got - want).norm() <= 1e-5 * want.norm()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    split = _run(q, kv, offsets, grad, _two_tensors(offsets, 13, "triton"))
    for got, want in zip((out, dq, dkv), split):
        assert torch.equal(got, want)


def test_bf16_and_no_rows():
    """bf16 against the two-tensor call (the same kernels), and a batch whose examples have no rows."""
    lengths = [9, 30, 0, 4]
    q, kv, offsets = _inputs(lengths, 4, 2, 32, torch.bfloat16)
    grad = torch.randn(len(lengths), *q.shape, device=DEVICE, dtype=q.dtype)
    got = _run(q, kv, offsets, grad, lambda q, kv: packed_kv_attention(q, kv, offsets, 30, backend="triton"))
    want = _run(q, kv, offsets, grad, _two_tensors(offsets, 30, "triton"))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    q, kv, offsets = _inputs([0, 0], 4, 2, 32, torch.float32)
    out, dq, dkv = _run(
        q,
        kv,
        offsets,
        torch.ones(2, *q.shape, device=DEVICE),
        lambda q, kv: packed_kv_attention(q, kv, offsets, 0, backend="triton"),
    )
    assert out.shape == (2, 4, 2, 32) and not out.any() and not dq.any() and dkv.shape == (0, 2, 2, 32)


def test_flops_and_bad_input():
    """FlopCounterMode counts the op as jagged attention (forward 4 H D pairs, backward 2.5x); bad
    arguments get a ValueError naming them."""
    lengths = [5, 0, 12]
    q, kv, offsets = _inputs(lengths, 3, 2, 16, torch.float32)
    with FlopCounterMode(display=False) as counter:
        packed_kv_attention(q, kv, offsets, 12, backend="triton").sum().backward()
    pairs = num_visible_pairs(torch.tensor([3, 3, 3]), torch.tensor(lengths))
    assert counter.get_total_flops() == 4 * 2 * 16 * pairs * 7 // 2
    with pytest.raises(ValueError, match=r"q must be \[N, H, D\] and kv \[T, 2, H, D\]"):
        packed_kv_attention(q, kv[:, :1], offsets, 12)
    with pytest.raises(ValueError, match="offsets must be int32 or int64"):
        packed_kv_attention(q, kv, offsets.float(), 12)
    with pytest.raises(ValueError, match="max_len=5 is less than the longest sequence"):
        packed_kv_attention(q, kv, offsets, 5, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_seed_pooling_shapes_eager_and_compiled():
    """Kunlun's seed pooling at gem_base's shapes (32 seeds x 4 heads of 128, histories up to 512
    rows) in bf16: equal to the two-tensor call, eager and under torch.compile. Without autotuning,
    so that every call launches the same tiles. Under compile the broadcast dQ's sum over the batch
    (float32, in the op's body) is Inductor's reduction, whose configs it times at compile, so it
    may add in another order than ``Tensor.sum``: there dQ is compared to a bf16 ulp (the test
    failed once inside the GPU tier, bit for bit, and passed alone); the output and d kv, the
    kernels' own, stay bit for bit."""
    lengths = torch.randint(0, 513, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    q, kv, offsets = _inputs(lengths, 32, 4, 128, torch.bfloat16, device="cuda")
    grad = torch.randn(len(lengths), *q.shape, device="cuda", dtype=q.dtype)
    with testing.override(autotune=False):
        want = _run(q, kv, offsets, grad, _two_tensors(offsets, 512, "triton"))
        eager = _run(q, kv, offsets, grad, lambda q, kv: packed_kv_attention(q, kv, offsets, 512))
        compiled = torch.compile(lambda q, kv: packed_kv_attention(q, kv * 1.0, offsets, 512), fullgraph=True)
        compiled = _run(q, kv, offsets, grad, compiled)
    for a, b in zip(eager, want):
        assert torch.equal(a, b)
    (out, dq, dkv), (want_out, want_dq, want_dkv) = compiled, want
    assert torch.equal(out, want_out) and torch.equal(dkv, want_dkv)
    torch.testing.assert_close(dq, want_dq, rtol=2**-7, atol=1e-4)
