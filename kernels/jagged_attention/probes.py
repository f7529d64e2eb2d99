"""Build checks (``kernels.fallback.triton_usable``): each builds and launches every Triton kernel
of one variant of an op once, on tiny inputs, through the launchers themselves (no dispatcher, no
autograd, no tracing: it runs as it would eagerly, also when Dynamo calls it while it traces), with
the call's settings that the Triton builds depend on (``settings.build_flags``, the variant's last
items before the device) and the Gluon kernels off (``settings.triton_only``). A size given as None
(the check under ``torch.compile``) takes gem_base's: head dim 128. Without a GPU the kernels run on the CPU (in
Triton's interpreter, or failing to launch without it, which is a fallback too)."""

from __future__ import annotations

import math

import torch

from kernels.fallback import device_of
from kernels.jagged_attention import op, settings
from kernels.jagged_attention.call import AttentionCall
from kernels.jagged_attention.inputs import make_inputs
from kernels.jagged_attention.triton_common import identity


def _equal_offsets(num_batches: int, rows: int, device) -> torch.Tensor:
    return torch.arange(num_batches + 1, device=device, dtype=torch.int32) * rows


def _forward_backward(q, k, v, q_offsets, kv_offsets, call: AttentionCall) -> None:
    """``op``'s forward and backward launchers, as the registered ops call them."""
    sizes, activation, scales = call.op_args()
    out, lse, order = op._gdpa_forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, identity)
    grad_out = torch.randn_like(out)
    op._backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, sizes, activation, scales, identity)


def jagged_attention(
    activation, dtype, head_dim, causal, windowed, blocked, layout, autotune, tune_space, packed_act, store_ds, device
) -> None:
    """Every kernel of one variant of ``kernels.jagged_attention`` (its layout as the entry point
    hands it to the ops: dense K/V as jagged rows of equal lengths, a broadcast Q's offsets)."""
    head_dim = head_dim or 128
    inputs = make_inputs(
        [5, 2], [4, 3], num_heads=1, head_dim=head_dim, layout=layout, num_dense_kv=4, num_queries=3,
        dtype=getattr(torch, dtype), device=device_of(device), requires_grad=False,
    )  # fmt: skip
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len = inputs.args()
    num_batches = k.shape[0] if kv_offsets is None else kv_offsets.numel() - 1
    if kv_offsets is None:
        max_kv_len = k.shape[1]
        kv_offsets = _equal_offsets(num_batches, max_kv_len, q.device)
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    if q_offsets is None:
        max_q_len = q.shape[0]
        q_offsets = _equal_offsets(num_batches, max_q_len, q.device)
    call = AttentionCall(
        max_q_len,
        max_kv_len,
        activation,
        1 / math.sqrt(head_dim),
        1.0 if activation == "softmax" else 0.25,
        bool(causal),
        1 if windowed else -1,
        2 if blocked else 0,
        layout == "broadcast_q",
        settings=settings.triton_only(autotune, tune_space, packed_act, store_ds),
    )
    _forward_backward(q, k, v, q_offsets, kv_offsets, call)


def gluon_gdpa(activation, dtype, head_dim, device, gluon=True, gluon_bwd=True, gluon_min_q_len=128) -> None:
    """The Gluon kernels that a GDPA variant's opaque ops may launch (the forward, the stored-dS
    dK/dV; ``gluon`` / ``gluon_bwd``: those the call's settings turn on), on one example and head of
    ``gluon_min_q_len + 1`` rows, which they take where they apply; on real tensors while Dynamo
    traces (``gluon_common.real_tensors``). Each launch falls back where it fails
    (``launch.forward`` / ``launch.backward``)."""
    if not torch.cuda.is_available():
        return  # the Gluon kernels run on sm_90 GPUs only
    from kernels.jagged_attention import gluon_common

    config = settings.KernelSettings(gluon=bool(gluon), gluon_bwd=bool(gluon_bwd), gluon_min_q_len=gluon_min_q_len)
    rows = config.gluon_min_q_len + 1
    inputs = make_inputs([rows], [rows], num_heads=1, head_dim=head_dim, dtype=getattr(torch, dtype),
                         device=device_of(device), requires_grad=False)  # fmt: skip
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len = inputs.args()
    call = AttentionCall(max_q_len, max_kv_len, activation, 1 / math.sqrt(head_dim), 0.25, settings=config)
    with gluon_common.real_tensors():
        _forward_backward(q, k, v, q_offsets, kv_offsets, call)


def gluon_softmax(dtype, head_dim, device, gluon_min_q_len=128) -> None:
    """The Gluon kernel that the rotary self-attention's opaque forward may launch (the softmax
    forward), on one example and head of ``gluon_min_q_len + 1`` rows, on real tensors while
    Dynamo traces; its launch falls back where it fails (``launch.forward``)."""
    if not torch.cuda.is_available():
        return  # the Gluon kernels run on sm_90 GPUs only
    from kernels.jagged_attention import gluon_common

    rows = gluon_min_q_len + 1
    device = device_of(device)
    qkv = torch.randn(rows, 3, 1, head_dim, device=device, dtype=getattr(torch, dtype))
    angles = torch.randn(rows, head_dim // 2, device=device)
    offsets = torch.tensor([0, rows], device=device)
    config = settings.KernelSettings(gluon_min_q_len=gluon_min_q_len)
    call = AttentionCall(rows, rows, "softmax", 1 / math.sqrt(head_dim), packing="qkv", rotary=True, settings=config)
    sizes, activation, scales = call.op_args()
    with gluon_common.real_tensors():
        op._rope_forward(qkv, angles.cos(), angles.sin(), offsets, sizes, activation, scales, identity)


def rotary_self_attention(
    dtype, head_dim, causal, windowed, autotune, tune_space, packed_act, store_ds, device
) -> None:
    """The fused rotary self-attention's kernels (Q and K rotated on load, d qkv written whole)."""
    device, head_dim = device_of(device), head_dim or 128
    qkv = torch.randn(7, 3, 1, head_dim, device=device, dtype=getattr(torch, dtype))
    angles = torch.randn(7, head_dim // 2, device=device)
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([0, 5, 7], device=device)
    config = settings.triton_only(autotune, tune_space, packed_act, store_ds)
    call = AttentionCall(5, 5, "softmax", 1 / math.sqrt(head_dim), 1.0, bool(causal), 1 if windowed else -1,
                         packing="qkv", rotary=True, settings=config)  # fmt: skip
    sizes, activation, scales = call.op_args()
    out, lse, order, q, k = op._rope_forward(qkv, cos, sin, offsets, sizes, activation, scales, identity)
    op._rope_backward_kernels(
        torch.randn_like(out), q, k, qkv, out, lse, cos, sin, offsets, order, sizes, activation, scales, identity
    )


def packed_kv_attention(dtype, head_dim, autotune, tune_space, packed_act, store_ds, device) -> None:
    """Softmax attention of broadcast queries over a packed K/V projection."""
    device, head_dim = device_of(device), head_dim or 128
    q = torch.randn(3, 1, head_dim, device=device, dtype=getattr(torch, dtype))
    kv = torch.randn(7, 2, 1, head_dim, device=device, dtype=q.dtype)
    kv_offsets, q_offsets = torch.tensor([0, 5, 7], device=device), _equal_offsets(2, 3, device)
    call = AttentionCall(3, 5, "softmax", 1 / math.sqrt(head_dim), q_broadcast=True, packing="kv",
                         settings=settings.triton_only(autotune, tune_space, packed_act, store_ds))  # fmt: skip
    sizes, activation, scales = call.op_args()
    out, lse, order = op._kv_forward(q, kv, q_offsets, kv_offsets, sizes, activation, scales, identity)
    grad_out = torch.randn_like(out)
    op._kv_backward_kernels(
        grad_out, q, kv, out, lse, q_offsets, kv_offsets, order, sizes, activation, scales, identity
    )
