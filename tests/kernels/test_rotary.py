"""kernels.rotary: the Triton rotary kernels (forward and gradient) against the PyTorch reference,
and kernels.jagged_attention.rotary_self_attention (the attention kernels reading the packed
projection and turning dQ and dK back through the rotation) against the two calls it replaces.

CPU tier: Triton's interpreter at small shapes. GPU tier (``-m gpu``): gem_base's shapes, eager
and under torch.compile (Inductor launches the kernels).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kernels.rotary
from gem.models.sequence import rotary_tables
from kernels.jagged_attention import jagged_attention, num_visible_pairs, rotary_self_attention, testing
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


def _self_attention(qkv, cos, sin, offsets, grad, backend, **masks):
    """Output and d qkv of rotary self-attention on ``backend`` ("fused": Triton with the
    ``rotary_fused`` setting; "two-calls": rotary_qkv, then jagged_attention, on Triton), and the
    kernels it launched."""
    qkv.grad = None
    max_len = int((offsets[1:] - offsets[:-1]).max())
    with testing.record_paths() as paths, testing.override(rotary_fused=backend == "fused"):
        if backend == "two-calls":
            q, k, v = rotary_qkv(qkv, cos, sin, backend="triton")
            out = jagged_attention(q, k, v, offsets, offsets, max_len, max_len, backend="triton", **masks)
        else:
            out = rotary_self_attention(
                qkv, cos, sin, offsets, max_len, backend="triton" if backend == "fused" else backend, **masks
            )
        out.backward(grad)
    return out.detach().float(), qkv.grad.float(), list(paths)


ROPE_MASKS = {  # and the dQ kernel each takes
    "none": ({}, "dq_from_ds"),
    "causal": ({"causal": True}, "dq"),
    "window": ({"window": 3}, "dq"),
}


@pytest.mark.parametrize("mask", ROPE_MASKS)
@pytest.mark.parametrize("head_dim", [16, 32])
def test_self_attention_matches_reference(mask, head_dim):
    """The fused path (V read in place, dQ and dK turned back in the kernels' stores) against the
    reference in float32, output and every part of d qkv; and the kernels it chose."""
    masks, dq_kernel = ROPE_MASKS[mask]
    lengths = [5, 0, 13, 1]
    qkv, cos, sin = _inputs(lengths, 2, head_dim, torch.float32)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    grad = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE)
    out, dqkv, paths = _self_attention(qkv, cos, sin, offsets, grad, "fused", **masks)
    ref, ref_dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "reference", **masks)
    assert paths == ["triton_fwd", "triton_dkdv", dq_kernel]
    assert (out - ref).norm() <= 1e-5 * ref.norm()
    for part in range(3):  # dQ, dK, dV
        assert (dqkv[:, part] - ref_dqkv[:, part]).norm() <= 1e-5 * ref_dqkv[:, part].norm(), part


def test_self_attention_recomputed_dq_and_bf16():
    """bf16 against the two calls it replaces (the same rounding of Q, K and V), with the
    stored-dS backward off: the recomputing dQ kernel turns dQ back too."""
    lengths = [9, 30, 0, 4]
    qkv, cos, sin = _inputs(lengths, 2, 32, torch.bfloat16)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    grad = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE, dtype=qkv.dtype)
    with testing.override(store_ds=False):
        out, dqkv, paths = _self_attention(qkv, cos, sin, offsets, grad, "fused")
        ref, ref_dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "two-calls")
    assert paths[-1] == "dq"
    assert (out - ref).norm() <= 1e-2 * ref.norm()
    assert (dqkv - ref_dqkv).norm() <= 1e-2 * ref_dqkv.norm()


@pytest.mark.parametrize("head_dim, fused", [(16, False), (24, True)])
def test_self_attention_runs_the_two_calls_unless_fused_applies(monkeypatch, head_dim, fused):
    """The fused kernels run only with the setting and a power-of-two head dim; otherwise
    rotary_qkv, then jagged_attention (the same result)."""
    rotations = []
    rotate_qk = kernels.rotary.rotate_qk
    monkeypatch.setattr(kernels.rotary, "rotate_qk", lambda *args: rotations.append(1) or rotate_qk(*args))
    lengths = [6, 11]
    qkv, cos, sin = _inputs(lengths, 2, head_dim, torch.float32)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    grad = torch.randn(qkv.shape[0], *qkv.shape[2:], device=DEVICE)
    out, dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "fused" if fused else "triton")
    assert not rotations
    ref, ref_dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "reference")
    assert (out - ref).norm() <= 1e-5 * ref.norm()
    assert (dqkv - ref_dqkv).norm() <= 1e-5 * ref_dqkv.norm()
    _self_attention(qkv, cos, sin, offsets, grad, "fused")
    assert len(rotations) == (head_dim == 16)


@pytest.mark.parametrize("case", ["off", "on", "unverified release"])
def test_gluon_compiled_sends_unmasked_rotary_calls_to_the_opaque_op(case, monkeypatch):
    """settings.gluon_compiled: under torch.compile an unmasked rotary self-attention goes to the
    opaque op, which launches its kernels itself (the Gluon softmax forward where it applies), but
    only on a Triton release the Gluon softmax forward passed the gate on; a causal call stays on
    the traced op. The same outputs and gradients as eager."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from kernels.jagged_attention import call

    if case == "unverified release":  # (the kernel tests run every Gluon kernel as verified)
        monkeypatch.setattr(call, "_allow_unverified", False)
        monkeypatch.setitem(call.GLUON_VERIFIED, "gluon_softmax_fwd", ())
    lengths = [6, 0, 11]
    qkv, cos, sin = _inputs(lengths, 2, 16, torch.float32)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)

    def attention(x):
        return sum(
            rotary_self_attention(x, cos, sin, offsets, 11, causal=causal, backend="triton") for causal in (False, True)
        )

    graphs = EagerAndRecordGraphs()
    torch._dynamo.reset()
    with testing.override(rotary_fused=True, gluon_compiled=case != "off"):
        out = torch.compile(attention, fullgraph=True, backend=graphs)(qkv)
        (grad,) = torch.autograd.grad(out.sum(), qkv)
        ref = attention(qkv)
        (ref_grad,) = torch.autograd.grad(ref.sum(), qkv)
    torch._dynamo.reset()
    assert (out - ref).norm() <= 1e-6 * ref.norm() and (grad - ref_grad).norm() <= 1e-6 * ref_grad.norm()
    (graph,) = graphs.graphs
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    opaque = case == "on"
    assert ops.count("gem_kernels.rotary_self_attention_fwd_eager") == opaque
    assert ops.count("gem_kernels.rotary_self_attention_fwd") == 2 - opaque


def test_the_opaque_rotary_ops_count_their_flops():
    """FlopCounterMode counts the opaque pair as the traced one (forward 4 H D pairs, backward 2.5x)."""
    lengths = [5, 0, 12]
    qkv, cos, sin = _inputs(lengths, 2, 16, torch.float32)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    with testing.override() as config:
        args = testing.AttentionCall(12, 12, "softmax", 0.25, packing="qkv", rotary=True, settings=config).op_args()
    with FlopCounterMode(display=False) as counter:
        out, *_ = torch.ops.gem_kernels.rotary_self_attention_fwd_eager(qkv, cos, sin, offsets, *args)
        out.sum().backward()
    pairs = num_visible_pairs(torch.tensor(lengths), torch.tensor(lengths))
    assert counter.get_total_flops() == 4 * 2 * 16 * pairs * 7 // 2
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0


def test_self_attention_flops_and_bad_input():
    """FlopCounterMode counts the fused op as jagged attention (forward 4 H D pairs, backward 2.5x);
    bad arguments get a ValueError naming them."""
    lengths = [5, 0, 12]
    qkv, cos, sin = _inputs(lengths, 2, 32, torch.float32)
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    with FlopCounterMode(display=False) as counter, testing.override(rotary_fused=True):
        rotary_self_attention(qkv, cos, sin, offsets, 12, causal=True, backend="triton").sum().backward()
    pairs = num_visible_pairs(torch.tensor(lengths), torch.tensor(lengths), causal=True)
    assert counter.get_total_flops() == 4 * 2 * 32 * pairs * 7 // 2
    with pytest.raises(ValueError, match="offsets must be int32 or int64"):
        rotary_self_attention(qkv, cos, sin, offsets.float(), 12, backend="triton")
    with pytest.raises(ValueError, match="max_len=5 is less than the longest sequence"):
        rotary_self_attention(qkv, cos, sin, offsets, 5, backend="triton")
    with pytest.raises(ValueError, match="window=-1 must be >= 0"):
        rotary_self_attention(qkv, cos, sin, offsets, 12, window=-1, backend="triton")
    with pytest.raises(ValueError, match=r"cos must be \[T, D/2\]"):
        rotary_self_attention(qkv, cos[:, :3], sin, offsets, 12, backend="triton")


@gpu
@requires_cuda
@pytest.mark.parametrize("mask", ROPE_MASKS)
def test_gpu_self_attention_gem_base_shapes_eager_and_compiled(mask):
    """gem_base's self-attention (4 heads of 128, histories up to 512 rows) in bf16: the fused
    path against the two calls, eager and under torch.compile (Inductor launches the kernels)."""
    masks, _ = ROPE_MASKS[mask]
    lengths = torch.randint(0, 513, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    qkv, cos, sin = _inputs(lengths, 4, 128, torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    grad = torch.randn(qkv.shape[0], 4, 128, device="cuda", dtype=qkv.dtype)
    out, dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "fused", **masks)
    ref, ref_dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "two-calls", **masks)
    assert (out - ref).norm() <= 1e-2 * ref.norm()
    for part in range(3):
        assert (dqkv[:, part] - ref_dqkv[:, part]).norm() <= 1e-2 * ref_dqkv[:, part].norm(), part

    def layer(x):
        return rotary_self_attention(x * 1.0, cos, sin, offsets, max(lengths), **masks)

    # Inductor launches the Triton kernels alone, so the eager call it must equal bit for bit takes
    # them too (the kernel tests run the unverified Gluon softmax forward where it applies)
    with testing.override(gluon=False):
        out, dqkv, _ = _self_attention(qkv, cos, sin, offsets, grad, "fused", **masks)
    qkv.grad = None
    with testing.override(rotary_fused=True):
        compiled = torch.compile(layer, fullgraph=True)(qkv)
        compiled.backward(grad)
    assert torch.equal(compiled.float(), out)
    assert torch.equal(qkv.grad.float(), dqkv)


@gpu
@requires_cuda
def test_gpu_compiled_self_attention_runs_the_gluon_softmax_forward():
    """settings.gluon_compiled, on a release the Gluon softmax forward passed the gate on (the
    kernel tests run it regardless, see conftest.py): gem_base's self-attention compiled under
    CUDA graphs (warm-up, recording, replay) goes through the opaque op, which launches the Gluon
    forward; its output and d qkv equal the eager call's bit for bit (the same kernels)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need sm_90")
    lengths = torch.randint(0, 513, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    qkv, cos, sin = _inputs(lengths, 4, 128, torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    grad = torch.randn(qkv.shape[0], 4, 128, device="cuda", dtype=qkv.dtype)

    def layer(x):
        return rotary_self_attention(x * 1.0, cos, sin, offsets, max(lengths))

    with testing.override(gluon_compiled=True):
        out, dqkv, paths = _self_attention(qkv, cos, sin, offsets, grad, "fused")
        assert paths[0] == "gluon_fwd"
        torch._dynamo.reset()
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        with testing.override(rotary_fused=True), testing.record_paths() as compiled_paths:
            for _ in range(3):
                qkv.grad = None
                result = compiled(qkv)
                result.backward(grad)
    assert "gluon_fwd" in compiled_paths  # (launched eagerly in the warm-up; CUDA graphs replay unseen)
    assert torch.equal(result.float(), out)
    assert torch.equal(qkv.grad.float(), dqkv)
