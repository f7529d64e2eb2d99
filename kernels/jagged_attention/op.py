"""torch.library registration of the jagged attention kernels: the ops, their autograd, their FLOPs.

Ops in the ``gem_kernels`` namespace, ``triton_op`` so that ``torch.compile`` sees the Triton
kernels inside them (no graph break), and a ``FlopCounterMode`` counts them all:

* ``gem_kernels::jagged_attention_fwd(...) -> (out, lse, batch_order)``
* ``gem_kernels::jagged_attention_bwd(grad_out, ...) -> (dq, dk, dv)``
* ``gem_kernels::jagged_attention_fwd_eager`` / ``jagged_attention_bwd_eager``: the same two as
  opaque ``custom_op`` s, which launch their kernels themselves, the Gluon ones included, where
  ``torch.compile`` would trace the ``triton_op`` s (``settings.gluon_compiled``)
* ``gem_kernels::rotary_self_attention_fwd(qkv, cos, sin, ...) -> (out, lse, batch_order, q, k)``
  (softmax self-attention over a packed projection, Q and K rotated by ``kernels.rotary``)
* ``gem_kernels::rotary_self_attention_bwd(grad_out, ...) -> d qkv`` (the same kernels, writing
  the packed gradient, dQ and dK turned back through the rotation as they are stored)
* ``gem_kernels::rotary_self_attention_fwd_eager`` / ``rotary_self_attention_bwd_eager``: the
  same two as opaque ``custom_op`` s, for the Gluon softmax forward under ``torch.compile``
* ``gem_kernels::packed_kv_attention_fwd`` / ``_bwd`` (broadcast queries over a packed K/V
  projection, the gradient of ``kv`` written whole)

Every op takes one call (``call.AttentionCall``) in its ``sizes``, ``activation`` and ``scales``
arguments (``AttentionCall.op_args`` / ``of_op``). The kernels' choice is ``call.py``'s, their
launch ``launch.py``'s. The forward computes the order in which the kernels' programs take the
examples (``batch_order.py``) and returns it for the backward. Callers use
:func:`kernels.jagged_attention` and its siblings, which validate, normalize layouts, build the
call and call :func:`jagged_attention_triton` / :func:`rotary_self_attention_triton` /
:func:`packed_kv_attention_triton` below.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from kernels import fallback, rotary  # (modules: kernels.rotary imports this package's triton_common)
from kernels.jagged_attention import call as call_module
from kernels.jagged_attention import launch
from kernels.jagged_attention.batch_order import batch_order
from kernels.jagged_attention.call import AttentionCall
from kernels.jagged_attention.reference import num_visible_pairs
from kernels.jagged_attention.triton_common import (
    OP_WRAP,
    define_op,
    fake_without_launch,
    identity,
    no_launch,
    unmasked,
    unmasked_pointwise,
)

# ---------------------------------------------------------------------------------------
# the registered ops
# ---------------------------------------------------------------------------------------


# The ops take their scalars packed: sizes = [max_q_len, max_kv_len, causal, window, block_size,
# q_broadcast, the settings the launchers read] and scales = [scale, post_scale] (fewer schema
# arguments cost less per call in PyTorch's custom-op autograd path; measured in
# docs/log/kernels.md): AttentionCall.op_args packs them, AttentionCall.of_op unpacks them.
def _forward(q, k, v, q_offsets, kv_offsets, call: AttentionCall, wrap):
    """(out, lse, batch_order): the forward, and the order its programs took the examples in
    (longest first), which the backward's take too."""
    order = batch_order(q_offsets, kv_offsets, wrap=wrap)
    out, lse = launch.forward(q, k, v, q_offsets, kv_offsets, order, call, wrap=wrap)
    return out, lse, order


def _gdpa_forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, wrap):
    return _forward(q, k, v, q_offsets, kv_offsets, AttentionCall.of_op(sizes, activation, scales), wrap)


def _forward_op(wrap):
    """The forward op's function, launching through ``wrap``."""

    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offsets: torch.Tensor,
        kv_offsets: torch.Tensor,
        sizes: list[int],
        activation: str,
        scales: list[float],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _gdpa_forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, wrap)

    return forward


def _backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, sizes, activation, scales, wrap):
    call = AttentionCall.of_op(sizes, activation, scales)
    return launch.backward(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, call, wrap=wrap)


def _backward_op(wrap):
    """The backward op's function, launching through ``wrap``."""

    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        q_offsets: torch.Tensor,
        kv_offsets: torch.Tensor,
        batch_order: torch.Tensor,
        sizes: list[int],
        activation: str,
        scales: list[float],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_kernels(
            grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order, sizes, activation, scales, wrap
        )

    return backward


def _define_opaque_pair(name: str, forward_op, backward_op, forward, backward_kernels) -> None:
    """``gem_kernels::<name>_fwd_eager`` / ``<name>_bwd_eager`` (settings.gluon_compiled): the
    launchers behind ``custom_op`` s, called as they are, which torch.compile calls without looking
    inside, so that they pick their kernels (the Gluon ones included) on the real tensors. Their
    outputs under tracing are the Triton launchers' allocations with nothing launched; the Gluon
    kernels allocate the same shapes (lse is a placeholder of one element without softmax)."""
    for part, make, launcher in (("fwd", forward_op, forward), ("bwd", backward_op, backward_kernels)):
        op = torch.library.custom_op(f"gem_kernels::{name}_{part}_eager", mutates_args=())(make(identity))
        op.register_fake(lambda *args, launcher=launcher: launcher(*args, wrap=no_launch))


_fwd_op = define_op("gem_kernels::jagged_attention_fwd")(_forward_op(OP_WRAP))
_bwd_op = define_op("gem_kernels::jagged_attention_bwd")(_backward_op(OP_WRAP))
fake_without_launch(_fwd_op, _gdpa_forward)
fake_without_launch(_bwd_op, _backward_kernels)
_define_opaque_pair("jagged_attention", _forward_op, _backward_op, _gdpa_forward, _backward_kernels)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, *params = inputs
    out, lse, order = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, order)
    ctx.params = params  # sizes, activation, scales


def _autograd_backward(bwd_op):
    """The autograd formula of a forward op whose backward op is ``bwd_op``."""

    def backward(ctx, grad_out, grad_lse, grad_order):
        q, k, v, out, lse, q_offsets, kv_offsets, order = ctx.saved_tensors
        dq, dk, dv = bwd_op(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, *ctx.params)
        return dq, dk, dv, None, None, *([None] * len(ctx.params))

    return backward


torch.library.register_autograd(
    "gem_kernels::jagged_attention_fwd",
    _autograd_backward(torch.ops.gem_kernels.jagged_attention_bwd),
    setup_context=_setup_context,
)
torch.library.register_autograd(
    "gem_kernels::jagged_attention_fwd_eager",
    _autograd_backward(torch.ops.gem_kernels.jagged_attention_bwd_eager),
    setup_context=_setup_context,
)


def _forward_flops(q, kv_offsets, q_offsets, sizes) -> int:
    """4 * H * D * (visible pairs on the true jagged lengths); an upper bound under tracing."""
    max_q_len, max_kv_len, causal, window, block_size = sizes[:5]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_batches = kv_offsets.shape[0] - 1
    try:
        q_lengths = q_offsets[1:] - q_offsets[:-1]
        kv_lengths = kv_offsets[1:] - kv_offsets[:-1]
        pairs = num_visible_pairs(
            q_lengths, kv_lengths, causal, window if window >= 0 else None, block_size if block_size > 0 else None
        )
    except Exception:  # fake / meta tensors carry no lengths: count the padded bound
        pairs = num_batches * max_q_len * max_kv_len
    return 4 * num_heads * head_dim * pairs


@register_flop_formula(
    [torch.ops.gem_kernels.jagged_attention_fwd, torch.ops.gem_kernels.jagged_attention_fwd_eager], get_raw=True
)
def _fwd_flop_formula(q, k, v, q_offsets, kv_offsets, sizes, *args, out_val=None, **kwargs) -> int:
    return _forward_flops(q, kv_offsets, q_offsets, sizes)


@register_flop_formula(
    [torch.ops.gem_kernels.jagged_attention_bwd, torch.ops.gem_kernels.jagged_attention_bwd_eager], get_raw=True
)
def _bwd_flop_formula(
    grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order, sizes, *args, out_val=None, **kwargs
) -> int:
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (+ S recomputed): 2.5 x forward.
    return 5 * _forward_flops(q, kv_offsets, q_offsets, sizes) // 2


# ---------------------------------------------------------------------------------------
# self-attention over a packed, rotary-embedded Q/K/V projection
# ---------------------------------------------------------------------------------------


def _rope_forward(qkv, cos, sin, offsets, sizes, activation, scales, wrap):
    """(out, lse, batch_order, q, k): Q and K rotated (``kernels.rotary``; kept for the backward),
    V read from ``qkv`` in place."""
    q, k = rotary.rotate_qk(qkv, cos, sin, wrap)
    call = AttentionCall.of_op(sizes, activation, scales, packing="qkv", rotary=True)
    out, lse, order = _forward(q, k, qkv[:, 2], offsets, offsets, call, wrap)
    return out, lse, order, q, k


def _rope_forward_op(wrap):
    """The rotary forward op's function, launching through ``wrap``."""

    def forward(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        offsets: torch.Tensor,
        sizes: list[int],
        activation: str,
        scales: list[float],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _rope_forward(qkv, cos, sin, offsets, sizes, activation, scales, wrap)

    return forward


def _rope_backward_kernels(grad_out, q, k, qkv, out, lse, cos, sin, offsets, order, sizes, activation, scales, wrap):
    """``d qkv``: the kernels write dQ, dK and dV into it, dQ and dK turned back through the rotation."""
    dqkv = qkv.new_empty(qkv.shape)
    launch.backward(
        grad_out,
        q,
        k,
        qkv[:, 2],
        out,
        lse,
        offsets,
        offsets,
        order,
        AttentionCall.of_op(sizes, activation, scales, packing="qkv", rotary=True),
        wrap=wrap,
        packed_grad=dqkv,
        rope=(cos, sin),
    )
    return dqkv


def _rope_backward_op(wrap):
    """The rotary backward op's function, launching through ``wrap``."""

    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        qkv: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        offsets: torch.Tensor,
        batch_order: torch.Tensor,
        sizes: list[int],
        activation: str,
        scales: list[float],
    ) -> torch.Tensor:
        return _rope_backward_kernels(
            grad_out, q, k, qkv, out, lse, cos, sin, offsets, batch_order, sizes, activation, scales, wrap
        )

    return backward


_rope_fwd_op = define_op("gem_kernels::rotary_self_attention_fwd")(_rope_forward_op(OP_WRAP))
_rope_bwd_op = define_op("gem_kernels::rotary_self_attention_bwd")(_rope_backward_op(OP_WRAP))
fake_without_launch(_rope_fwd_op, _rope_forward)
fake_without_launch(_rope_bwd_op, _rope_backward_kernels)
_define_opaque_pair("rotary_self_attention", _rope_forward_op, _rope_backward_op, _rope_forward, _rope_backward_kernels)


def _rope_setup_context(ctx, inputs, output) -> None:
    qkv, cos, sin, offsets, *params = inputs
    out, lse, order, q, k = output
    ctx.save_for_backward(q, k, qkv, out, lse, cos, sin, offsets, order)
    ctx.params = params  # sizes, activation, scales


def _rope_autograd_backward(bwd_op):
    """The autograd formula of a rotary forward op whose backward op is ``bwd_op``."""

    def backward(ctx, grad_out, *unused):  # lse, order, q and k take no gradient
        dqkv = bwd_op(grad_out, *ctx.saved_tensors, *ctx.params)
        return dqkv, None, None, None, *([None] * len(ctx.params))

    return backward


torch.library.register_autograd(
    "gem_kernels::rotary_self_attention_fwd",
    _rope_autograd_backward(torch.ops.gem_kernels.rotary_self_attention_bwd),
    setup_context=_rope_setup_context,
)
torch.library.register_autograd(
    "gem_kernels::rotary_self_attention_fwd_eager",
    _rope_autograd_backward(torch.ops.gem_kernels.rotary_self_attention_bwd_eager),
    setup_context=_rope_setup_context,
)


@register_flop_formula(
    [torch.ops.gem_kernels.rotary_self_attention_fwd, torch.ops.gem_kernels.rotary_self_attention_fwd_eager],
    get_raw=True,
)
def _rope_fwd_flop_formula(qkv, cos, sin, offsets, sizes, *args, out_val=None, **kwargs) -> int:
    return _forward_flops(qkv[:, 0], offsets, offsets, sizes)


@register_flop_formula(
    [torch.ops.gem_kernels.rotary_self_attention_bwd, torch.ops.gem_kernels.rotary_self_attention_bwd_eager],
    get_raw=True,
)
def _rope_bwd_flop_formula(
    grad_out, q, k, qkv, out, lse, cos, sin, offsets, batch_order, sizes, *args, **kwargs
) -> int:
    return 5 * _forward_flops(q, offsets, offsets, sizes) // 2


# ---------------------------------------------------------------------------------------
# broadcast queries over a packed K/V projection: the gradient of kv written whole
# ---------------------------------------------------------------------------------------


def _kv_forward(q, kv, q_offsets, kv_offsets, sizes, activation, scales, wrap):
    """(out, lse, batch_order), K and V read from ``kv [T, 2, H, D]`` in place."""
    call = AttentionCall.of_op(sizes, activation, scales, packing="kv")
    return _forward(q, kv[:, 0], kv[:, 1], q_offsets, kv_offsets, call, wrap)


@define_op("gem_kernels::packed_kv_attention_fwd")
def _kv_fwd_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    sizes: list[int],
    activation: str,
    scales: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kv_forward(q, kv, q_offsets, kv_offsets, sizes, activation, scales, OP_WRAP)


def _kv_backward_kernels(grad_out, q, kv, out, lse, q_offsets, kv_offsets, order, sizes, activation, scales, wrap):
    """``(dq, d kv)``: the dK/dV kernel writes both halves of ``d kv``."""
    dkv = kv.new_empty(kv.shape)
    dq, _, _ = launch.backward(
        grad_out,
        q,
        kv[:, 0],
        kv[:, 1],
        out,
        lse,
        q_offsets,
        kv_offsets,
        order,
        AttentionCall.of_op(sizes, activation, scales, packing="kv"),
        wrap=wrap,
        packed_grad=dkv,
    )
    return dq, dkv


@define_op("gem_kernels::packed_kv_attention_bwd")
def _kv_bwd_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    batch_order: torch.Tensor,
    sizes: list[int],
    activation: str,
    scales: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kv_backward_kernels(
        grad_out, q, kv, out, lse, q_offsets, kv_offsets, batch_order, sizes, activation, scales, OP_WRAP
    )


fake_without_launch(_kv_fwd_op, _kv_forward)
fake_without_launch(_kv_bwd_op, _kv_backward_kernels)


def _kv_setup_context(ctx, inputs, output) -> None:
    q, kv, q_offsets, kv_offsets, *params = inputs
    out, lse, order = output
    ctx.save_for_backward(q, kv, out, lse, q_offsets, kv_offsets, order)
    ctx.params = params  # sizes, activation, scales


def _kv_backward(ctx, grad_out, *unused):  # lse and order take no gradient
    dq, dkv = torch.ops.gem_kernels.packed_kv_attention_bwd(grad_out, *ctx.saved_tensors, *ctx.params)
    return dq, dkv, None, None, *([None] * len(ctx.params))


torch.library.register_autograd("gem_kernels::packed_kv_attention_fwd", _kv_backward, setup_context=_kv_setup_context)


@register_flop_formula(torch.ops.gem_kernels.packed_kv_attention_fwd, get_raw=True)
def _kv_fwd_flop_formula(q, kv, q_offsets, kv_offsets, sizes, *args, out_val=None, **kwargs) -> int:
    return _forward_flops(q, kv_offsets, q_offsets, sizes)


@register_flop_formula(torch.ops.gem_kernels.packed_kv_attention_bwd, get_raw=True)
def _kv_bwd_flop_formula(grad_out, q, kv, out, lse, q_offsets, kv_offsets, batch_order, sizes, *args, **kwargs) -> int:
    return 5 * _forward_flops(q, kv_offsets, q_offsets, sizes) // 2


def packed_kv_attention_triton(q, kv, q_offsets, kv_offsets, call: AttentionCall) -> torch.Tensor:
    """Calls the registered op: softmax attention of the broadcast ``q [N, H, D]`` (``q_offsets``: N
    rows an example) over each example's rows of ``kv``; ``[B * N, H, D]``, differentiable in ``q``
    and ``kv``. ``call``: the entry point's (``q_broadcast``, ``packing="kv"``)."""
    out, _, _ = torch.ops.gem_kernels.packed_kv_attention_fwd(q, kv, q_offsets, kv_offsets, *call.op_args())
    return out


@torch.compiler.assume_constant_result
def _gluon_softmax_verified() -> bool:
    """``call.gluon_verified("gluon_softmax_fwd")``, a constant for Dynamo, which calls this while it traces."""
    return call_module.gluon_verified("gluon_softmax_fwd")


def rotary_self_attention_triton(qkv, cos, sin, offsets, call: AttentionCall) -> torch.Tensor:
    """Calls the registered rotary self-attention op (softmax, differentiable in ``qkv``). Under
    ``torch.compile`` with ``settings.gluon_compiled``, an unmasked call on a Triton release that
    the Gluon softmax forward passed the gate on (``call.GLUON_VERIFIED``) goes to the opaque op,
    as :func:`jagged_attention_triton`'s GDPA calls do, so that the Gluon forward runs there too."""
    opaque = (
        unmasked(*call.mask)
        and torch.compiler.is_compiling()
        and call.settings.gluon_compiled
        and call.settings.gluon
        and _gluon_softmax_verified()
    )
    if opaque and qkv.is_cuda and isinstance(qkv.shape[-1], int):
        variant = (fallback.dtype_name(qkv), qkv.shape[-1], qkv.device.index or 0, call.settings.gluon_min_q_len)
        fallback.gluon_checked("gluon_softmax", variant)
    fwd_op = (
        torch.ops.gem_kernels.rotary_self_attention_fwd_eager
        if opaque
        else torch.ops.gem_kernels.rotary_self_attention_fwd
    )
    out, _, _, _, _ = fwd_op(qkv, cos, sin, offsets, *call.op_args())
    return out


def jagged_attention_triton(q, k, v, q_offsets, kv_offsets, call: AttentionCall) -> torch.Tensor:
    """Calls the registered forward op (differentiable); tensors as in ``triton_fwd.forward``.
    Under ``torch.compile`` with ``settings.gluon_compiled``, a call the Gluon kernels may take (a
    pointwise activation, no mask, jagged queries) goes to the opaque op instead, which decides
    on the real tensors, as an eager call does; its Gluon kernels are launched once while Dynamo
    traces (``fallback.gluon_checked``), so that one that fails to build falls back there."""
    opaque = (
        unmasked_pointwise(call.activation, call.causal, call.window, call.block_size, call.q_broadcast)
        and torch.compiler.is_compiling()
        and call.settings.gluon_compiled
    )
    if opaque and q.is_cuda and isinstance(q.shape[-1], int):
        s = call.settings  # the Gluon kernels it turns on, and the rows they take
        variant = (call.activation, fallback.dtype_name(q), q.shape[-1], q.device.index or 0)
        fallback.gluon_checked("gluon_gdpa", (*variant, int(s.gluon), int(s.gluon_bwd), s.gluon_min_q_len))
    fwd_op = torch.ops.gem_kernels.jagged_attention_fwd_eager if opaque else torch.ops.gem_kernels.jagged_attention_fwd
    out, _, _ = fwd_op(q, k, v, q_offsets, kv_offsets, *call.op_args())
    return out


# Names that moved, kept here for their users (deprecated: import them from their new modules).
GLUON_VERIFIED = call_module.GLUON_VERIFIED  # deprecated: kernels.jagged_attention.call.GLUON_VERIFIED
gluon_verified = call_module.gluon_verified  # deprecated: kernels.jagged_attention.call.gluon_verified
store_ds_row = call_module.store_ds_row  # deprecated: kernels.jagged_attention.call.store_ds_row
launch_forward = launch.forward  # deprecated: kernels.jagged_attention.launch.forward (takes an AttentionCall)
launch_backward = launch.backward  # deprecated: kernels.jagged_attention.launch.backward (takes an AttentionCall)
