"""kernels.jagged_attention.persistent_bwd: the persistent softmax dK/dV over one flat list of query
tiles, against the reference's gradients (autograd through ``jagged_attention_reference``) and,
where it stores dS, against dS worked out in float64.

CPU tier: Triton's interpreter at small shapes whose lengths and head dim are not multiples of
the blocks, self-attention and different query and key lengths (examples without queries, without
keys), runs fewer and more than the items, a packed gradient. GPU tier (``-m gpu``): the
flagship's lengths in bf16, against the op's backward.
"""

from __future__ import annotations

import pytest
import torch

from kernels.jagged_attention import jagged_attention
from kernels.jagged_attention.call import store_ds_row
from kernels.jagged_attention.inputs import make_inputs
from kernels.jagged_attention.persistent_bwd import persistent_softmax_dkdv
from kernels.jagged_attention.persistent_fwd import persistent_schedule, persistent_softmax_forward
from kernels.jagged_attention.reference import jagged_attention_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SMALL = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)
CROSS = ([5, 0, 40, 1, 17, 33], [7, 3, 12, 0, 40, 33])  # query lengths, key lengths


def _problem(q_lengths, num_heads, head_dim, dtype, seed=0, kv_lengths=None, **options):
    """q, k, v, grad_out and the offsets and max lengths (``args``)."""
    inputs = make_inputs(
        q_lengths,
        kv_lengths,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        requires_grad=False,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    grad_out = torch.randn(inputs.q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(inputs.q)
    return inputs.q, inputs.k, inputs.v, grad_out, inputs.args()[3:]


def _lse_delta(q, k, v, grad_out, args, scale):
    """lse and delta, as the op's backward has them: from the persistent forward (log2 units)."""
    out, lse = persistent_softmax_forward(q, k, v, *args, scale, num_runs=2, **SMALL)
    delta = (out.float() * grad_out.float()).sum(-1).t().contiguous()
    return lse, delta


def _reference_grads(q, k, v, grad_out, args, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = jagged_attention_reference(*leaves, *args, activation="softmax", scale=scale)
    return torch.autograd.grad(out, leaves[1:], grad_out.double())


def _pairs(args):
    q_offsets, kv_offsets = (o.tolist() for o in args[:2])
    return list(zip(q_offsets[:-1], q_offsets[1:], kv_offsets[:-1], kv_offsets[1:]))


def _reference_ds(q, k, v, grad_out, args, scale):
    """Per example, ``[H, keys, queries]``: dS = P (dP - delta), transposed, in float64."""
    blocks = []
    for q0, q1, k0, k1 in _pairs(args):
        qb, dob = q[q0:q1].double(), grad_out[q0:q1].double()
        kb, vb = k[k0:k1].double(), v[k0:k1].double()
        p = torch.softmax(torch.einsum("qhd,khd->hqk", qb, kb) * scale, -1)
        dp = torch.einsum("qhd,khd->hqk", dob, vb)
        delta = (p * dp).sum(-1, keepdim=True)
        blocks.append((p * (dp - delta)).transpose(1, 2))
    return blocks


def _stored_ds(ds, args):
    """Each example's ``[H, keys, queries]`` of the stored dS (the rest of a row is not written)."""
    return [ds[:, k0:k1, : q1 - q0] for q0, q1, k0, k1 in _pairs(args)]


def _error(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("num_runs", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(CROSS[0], None), CROSS], ids=["self", "cross"])
def test_matches_the_reference_gradients(lengths, dtype, num_runs):
    q, k, v, grad_out, args = _problem(lengths[0], 2, 24, dtype, kv_lengths=lengths[1])
    scale = 24**-0.5
    lse, delta = _lse_delta(q, k, v, grad_out, args, scale)
    dk, dv = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, num_runs=num_runs, **SMALL)
    want_dk, want_dv = _reference_grads(q, k, v, grad_out, args, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert dk.dtype == dtype
    assert _error(dk, want_dk) < tolerance and _error(dv, want_dv) < tolerance


@pytest.mark.parametrize("block_m", [16, 32])
def test_stores_ds_where_asked(block_m):
    """Also with a scale, int32 offsets, max lengths above the longest examples, block_n != block_m."""
    q, k, v, grad_out, args = _problem(
        [9, 31, 2, 0, 5], 3, 16, torch.float32, seed=1, kv_lengths=[4, 31, 0, 6, 20], offsets_dtype=torch.int32,
        max_len_slack=20,
    )  # fmt: skip
    config = dict(block_m=block_m, block_n=8, num_warps=1, num_stages=1, num_runs=3)
    lse, delta = _lse_delta(q, k, v, grad_out, args, 0.3)
    ds = q.new_empty(3, k.shape[0], store_ds_row(args[2]))
    dk, dv = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, 0.3, ds=ds, **config)
    want_dk, want_dv = _reference_grads(q, k, v, grad_out, args, 0.3)
    assert _error(dk, want_dk) < 1e-5 and _error(dv, want_dv) < 1e-5
    for got, want in zip(_stored_ds(ds, args), _reference_ds(q, k, v, grad_out, args, 0.3)):
        if want.numel():
            assert _error(got, want) < 1e-5
    shared = persistent_schedule(args[1], args[0], args[3], args[2], 3, 8, block_m, 3)
    again_ds = torch.empty_like(ds)
    again = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, 0.3, ds=again_ds, schedule=shared, **config)
    assert torch.equal(again[0], dk) and torch.equal(again[1], dv)
    assert all(torch.equal(a, b) for a, b in zip(_stored_ds(again_ds, args), _stored_ds(ds, args)))


def test_writes_a_packed_gradient_through_one_buffer():
    """dK and dV into slices of one ``[T, 2, H, D]`` buffer (``dv is dk``, element offsets)."""
    q, k, v, grad_out, args = _problem([6, 19, 0], 2, 16, torch.float32, seed=2)
    lse, delta = _lse_delta(q, k, v, grad_out, args, 0.25)
    packed = torch.full((k.shape[0], 2, 2, 16), float("nan"))
    buffer = packed.flatten(1, 2)
    persistent_softmax_dkdv(
        q, k, v, grad_out, lse, delta, *args, 0.25, dk=buffer, dv=buffer, offsets=(0, 2 * 16), num_runs=2, **SMALL
    )
    dk, dv = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, 0.25, num_runs=2, **SMALL)
    assert torch.equal(packed[:, 0], dk) and torch.equal(packed[:, 1], dv)


def test_bad_inputs_name_the_argument():
    q, k, v, grad_out, args = _problem([3, 4], 2, 16, torch.float32)
    lse = delta = torch.zeros(2, 7)
    with pytest.raises(ValueError, match=r"q and grad_out must be \[Tq, H, D\] alike"):
        persistent_softmax_dkdv(q, k, v, grad_out[:3], lse, delta, *args)
    with pytest.raises(ValueError, match="block_m must divide 128"):
        persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, block_m=48)
    with pytest.raises(ValueError, match="delta must have lse's strides"):
        persistent_softmax_dkdv(q, k, v, grad_out, lse, torch.zeros(7, 2).t(), *args)
    with pytest.raises(ValueError, match=r"ds must be \[H, Tk, store_ds_row\(max_q_len\)\]"):
        persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, ds=torch.empty(2, 7, 4))
    with pytest.raises(ValueError, match="rope: dK is turned back for a power-of-two head dim"):
        q24, k24, v24, grad24, args24 = _problem([3, 4], 2, 24, torch.float32)
        persistent_softmax_dkdv(q24, k24, v24, grad24, lse, delta, *args24, rope=(lse, lse))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flagship_lengths():
    """gem_base's self-attention (4 heads of 128, bf16) at the flagship's lengths, against the op's backward."""
    from benchmarks.attention import flagship_lengths

    q, k, v, grad_out, args = _problem(flagship_lengths()[:256].tolist(), 4, 128, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, *args, activation="softmax", backend="triton")
    want_dk, want_dv = torch.autograd.grad(out, leaves[1:], grad_out)
    lse = persistent_softmax_forward(q, k, v, *args)[1]
    delta = (out.detach().float() * grad_out.float()).sum(-1).t().contiguous()
    ds = q.new_empty(4, k.shape[0], store_ds_row(args[2]))
    dk, dv = persistent_softmax_dkdv(q, k, v, grad_out, lse, delta, *args, ds=ds)
    assert _error(dk, want_dk) < 2e-2 and _error(dv, want_dv) < 2e-2
