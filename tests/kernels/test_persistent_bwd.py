"""kernels.jagged_attention.persistent_bwd: the persistent softmax dK/dV over one flat list of query
tiles, against the reference's gradients (autograd through ``jagged_attention_reference``) and,
where it stores dS, against dS worked out in float64.

CPU tier: Triton's interpreter at small shapes whose lengths and head dim are not multiples of
the blocks, with empty examples, runs fewer and more than the items. GPU tier (``-m gpu``): the
flagship's lengths in bf16, against the op's backward.
"""

from __future__ import annotations

import pytest
import torch

from kernels.jagged_attention import jagged_attention
from kernels.jagged_attention.inputs import make_inputs
from kernels.jagged_attention.persistent_bwd import persistent_softmax_dkdv
from kernels.jagged_attention.persistent_fwd import persistent_schedule, persistent_softmax_forward
from kernels.jagged_attention.reference import jagged_attention_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SMALL = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)


def _problem(lengths, num_heads, head_dim, dtype, seed=0, **options):
    inputs = make_inputs(
        lengths,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        requires_grad=False,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    grad_out = torch.randn(inputs.q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(inputs.q)
    return inputs.q, inputs.k, inputs.v, grad_out, inputs.q_offsets, inputs.max_q_len


def _backward_inputs(q, k, v, grad_out, offsets, max_len, scale):
    """lse and delta, as the op's backward has them: from the persistent forward (log2 units)."""
    out, lse = persistent_softmax_forward(q, k, v, offsets, max_len, scale, num_runs=2, **SMALL)
    delta = (out.float() * grad_out.float()).sum(-1).t().contiguous()
    return lse, delta


def _reference_grads(q, k, v, grad_out, offsets, max_len, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = jagged_attention_reference(*leaves, offsets, offsets, max_len, max_len, activation="softmax", scale=scale)
    return torch.autograd.grad(out, leaves[1:], grad_out.double())


def _reference_ds(q, k, v, grad_out, offsets, scale):
    """``[H, T, T_b]`` per example: dS[h, key, query] = P (dP - delta), transposed, in float64."""
    blocks = []
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qb, kb, vb, dob = (t[start:end].double() for t in (q, k, v, grad_out))
        p = torch.softmax(torch.einsum("qhd,khd->hqk", qb, kb) * scale, -1)
        dp = torch.einsum("qhd,khd->hqk", dob, vb)
        delta = (p * dp).sum(-1, keepdim=True)
        blocks.append((p * (dp - delta)).transpose(1, 2))
    return blocks


def _stored_ds(ds, offsets):
    """Each example's ``[H, T_b, T_b]`` of the stored dS (the rest of a row is not written)."""
    bounds = offsets.tolist()
    return [ds[:, start:end, : end - start] for start, end in zip(bounds[:-1], bounds[1:])]


def _error(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("num_runs", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_gradients(dtype, num_runs):
    q, k, v, grad_out, offsets, max_len = _problem([5, 0, 40, 1, 17, 33], num_heads=2, head_dim=24, dtype=dtype)
    scale = 24**-0.5
    lse, delta = _backward_inputs(q, k, v, grad_out, offsets, max_len, scale)
    dk, dv, ds = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, offsets, max_len, num_runs=num_runs, **SMALL)
    want_dk, want_dv = _reference_grads(q, k, v, grad_out, offsets, max_len, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert dk.dtype == dtype and ds is None
    assert _error(dk, want_dk) < tolerance and _error(dv, want_dv) < tolerance


@pytest.mark.parametrize("block_m", [16, 32])
def test_stores_ds_where_asked(block_m):
    """Also with a scale, int32 offsets and a max_len above the longest example; block_n != block_m."""
    q, k, v, grad_out, offsets, max_len = _problem(
        [9, 31, 2, 0], 3, 16, torch.float32, seed=1, offsets_dtype=torch.int32, max_len_slack=20
    )
    config = dict(block_m=block_m, block_n=8, num_warps=1, num_stages=1, num_runs=3)
    lse, delta = _backward_inputs(q, k, v, grad_out, offsets, max_len, 0.3)
    dk, dv, ds = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, offsets, max_len, 0.3, store_ds=True, **config)
    want_dk, want_dv = _reference_grads(q, k, v, grad_out, offsets, max_len, 0.3)
    assert _error(dk, want_dk) < 1e-5 and _error(dv, want_dv) < 1e-5
    assert ds.shape == (3, q.shape[0], 128)
    for got, want in zip(_stored_ds(ds, offsets), _reference_ds(q, k, v, grad_out, offsets, 0.3)):
        if want.numel():
            assert _error(got, want) < 1e-5
    shared = persistent_schedule(offsets, max_len, 3, 8, block_m, 3)
    again = persistent_softmax_dkdv(
        q, k, v, grad_out, lse, delta, offsets, max_len, 0.3, store_ds=True, schedule=shared, **config
    )
    assert torch.equal(again[0], dk) and torch.equal(again[1], dv)
    assert all(torch.equal(a, b) for a, b in zip(_stored_ds(again[2], offsets), _stored_ds(ds, offsets)))


def test_bad_inputs_name_the_argument():
    q, k, v, grad_out, offsets, max_len = _problem([3, 4], num_heads=2, head_dim=16, dtype=torch.float32)
    lse = delta = torch.zeros(2, 7)
    with pytest.raises(ValueError, match=r"q, k, v, grad_out must be \[T, H, D\] alike"):
        persistent_softmax_dkdv(q, k, v, grad_out[:3], lse, delta, offsets, max_len)
    with pytest.raises(ValueError, match="block_m must divide 128"):
        persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, offsets, max_len, block_m=48)
    with pytest.raises(ValueError, match="delta must have lse's strides"):
        persistent_softmax_dkdv(q, k, v, grad_out, lse, torch.zeros(7, 2).t(), offsets, max_len)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flagship_lengths():
    """gem_base's self-attention (4 heads of 128, bf16) at the flagship's lengths, against the op's backward."""
    from benchmarks.attention import flagship_lengths

    q, k, v, grad_out, offsets, max_len = _problem(
        flagship_lengths()[:256].tolist(), num_heads=4, head_dim=128, dtype=torch.bfloat16
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, offsets, max_len, max_len, activation="softmax")
    want_dk, want_dv = torch.autograd.grad(out, leaves[1:], grad_out)
    lse = persistent_softmax_forward(q, k, v, offsets, max_len)[1]
    delta = (out.detach().float() * grad_out.float()).sum(-1).t().contiguous()
    dk, dv, _ = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, offsets, max_len, store_ds=True)
    assert _error(dk, want_dk) < 2e-2 and _error(dv, want_dv) < 2e-2
