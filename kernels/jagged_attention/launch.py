"""The launchers of one attention call (no autograd): the kernels that ``call.py`` chooses, with
the recoveries that only a launch can find out about.

* :func:`forward`: the Gluon forward (``gluon_fwd.py``) where :func:`call.choose_forward`
  says so, else the Triton one (``triton_fwd.py``);
* :func:`backward`: the stored-dS backward where :func:`call.choose_backward` says so (dK/dV
  store dS, dQ = dS K reads it), its dK/dV in Gluon (``gluon_bwd.py``) or Triton, else the Triton
  dK/dV and the recomputing dQ kernel (``triton_bwd.py``).

Recoveries: a Gluon launch that fails to build falls back to Triton (``kernels.fallback.guarded``,
once per variant); a stored-dS buffer without room on the device falls back to recomputing dQ.
The registered ops (``op.py``) call these; tools that compile the kernels call them with a
``wrap`` and an ``arch`` (e.g. ``(9, 0)`` to compile for Hopper without one).
"""

from __future__ import annotations

import warnings

import torch

from kernels import fallback
from kernels.jagged_attention import triton_bwd, triton_fwd
from kernels.jagged_attention.call import (
    AttentionCall,
    Operands,
    choose_backward,
    choose_forward,
    packed_act,
    store_ds_row,
)
from kernels.jagged_attention.triton_common import identity, launch_meta


def _variant(q, activation: str) -> str:
    """A Gluon launch's kernel variant, as its fallback is recorded: what its build depends on."""
    return f"{activation} {fallback.dtype_name(q)} D={q.shape[-1]}"


def _meta(q, call: AttentionCall, operands: Operands) -> dict:
    return launch_meta(q, call.activation, *call.mask, packed_act(call, operands))


def forward(
    q, k, v, q_offsets, kv_offsets, batch_order, call: AttentionCall, *, wrap=identity, arch=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the forward; tensors as ``triton_fwd.forward``'s. ``arch`` (a compute
    capability standing in for q's device's) is for tools that compile the kernels."""
    operands = Operands.of(q, k, v, kv_offsets, call, arch)
    meta = _meta(q, call, operands)
    if choose_forward(call, operands) == "gluon" and not fallback.failed("gluon_fwd", _variant(q, call.activation)):
        out = q.new_empty(q.shape)
        softmax = call.activation == "softmax"  # (else lse is a placeholder, unread by GDPA)
        lse = q.new_empty((q.shape[1], q.shape[0]) if softmax else (1,), dtype=torch.float32)

        def gluon():
            from kernels.jagged_attention import gluon_fwd

            gluon_fwd.forward(
                q,
                k,
                v,
                out,
                q_offsets,
                kv_offsets,
                batch_order,
                call.max_q_len,
                meta["ACTIVATION"],
                call.scale,
                triton_fwd.output_scale(call.activation, call.scale, call.post_scale),
                meta["PACKED_ACT"],
                lse=lse if softmax else None,
            )

        if fallback.guarded("gluon_fwd", _variant(q, call.activation), "triton", "kernels.gluon=false", gluon):
            return out, lse
    return triton_fwd.forward(q, k, v, q_offsets, kv_offsets, batch_order, call, meta, wrap)


def _store_ds_buffer(q, k, max_q_len) -> torch.Tensor | None:
    """The stored-dS buffer, or None (the backward then recomputes dQ) where the device has no
    room for it even under the cap: the caching allocator has already freed what it could."""
    shape = (q.shape[1], k.shape[0], store_ds_row(max_q_len))
    try:
        return q.new_empty(shape)
    except torch.OutOfMemoryError:
        mib = q.shape[1] * k.shape[0] * shape[2] * q.element_size() >> 20
        warnings.warn(
            f"jagged attention backward: no memory for the stored-dS buffer ({mib} MiB); dQ is "
            f"recomputed instead. Set experimental.kernels.store_ds_max_mib below {mib} to skip the "
            f"attempt, or kernels.store_ds=false.",
            stacklevel=2,
        )
        return None


def backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    q_offsets,
    kv_offsets,
    batch_order,
    call: AttentionCall,
    *,
    wrap=identity,
    arch=None,
    packed_grad: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` shaped like ``q, k, v``; arguments as :func:`forward`, ``grad_out`` shaped
    like ``out``. With ``call.q_broadcast``, dQ is computed per example in float32 and summed over
    the batch. The Triton kernels can write the gradient of a packed projection whole
    (``call.packing``): ``packed_grad`` ``[T, 3, H, D]`` receives dQ, dK and dV in its three slices
    for self-attention (Q, K and V on the same rows), ``[T, 2, H, D]`` dK and dV with a broadcast
    Q; the parts are returned as its views. ``rope`` ``(cos, sin)`` (``call.rotary``,
    self-attention) says Q and K are the rotated operands, whose gradients are turned back through
    the rotation as they are stored (head dim a power of 2)."""
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = out.shape[0]
    parts = 2 if call.q_broadcast else 3  # of a packed gradient
    if (packed_grad is not None) != bool(call.packing) or (rope is not None) != call.rotary:
        raise ValueError(
            f"packed_grad and rope must match the call's packing={call.packing!r} and rotary={call.rotary}"
        )
    if packed_grad is not None and packed_grad.shape[1] != parts:
        raise ValueError(
            f"packed_grad must be [T, {parts}, H, D] ({'dK, dV' if call.q_broadcast else 'dQ, dK, dV'}), "
            f"got {tuple(packed_grad.shape)}"
        )
    if rope is not None and call.q_broadcast:
        raise ValueError("rope is for self-attention: jagged Q, K and V on the same rows")
    operands = Operands.of(q, k, v, kv_offsets, call, arch)
    meta = _meta(q, call, operands)
    if rope is not None and not meta["EVEN_D"]:
        raise ValueError(f"rope: the kernels turn dQ and dK back for a power-of-two head dim, not {head_dim}")
    # Every row of an example is written by the kernels (an empty example has no rows).
    offsets = [0, 0, 0]  # of dQ, dK and dV from their tensors' data, in elements
    if packed_grad is not None:
        # One buffer and offsets into it, not views: torch.compile clones a mutated view with an
        # offset out of bounds (torch 2.11, pytorch#192226). [T, parts * H, D]: heads are D apart.
        dk = dv = packed_grad.flatten(1, 2)
        width = num_heads * head_dim
        offsets = [0, width, 2 * width] if parts == 3 else [0, 0, width]  # a broadcast dQ has its own buffer
    else:
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
    if call.q_broadcast:
        dq_rows = q.new_empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    elif packed_grad is not None:
        dq_rows = dk
    else:
        dq_rows = torch.empty_like(q)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or call.max_q_len == 0 or call.max_kv_len == 0:
        if packed_grad is None:
            return torch.zeros_like(q), dk.zero_(), dv.zero_()
        packed_grad.zero_()
        return packed_grad.unbind(1) if parts == 3 else (torch.zeros_like(q), *packed_grad.unbind(1))
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()

    if call.activation == "softmax":
        delta = triton_bwd.preprocess(out, grad_out, lse, meta["BLOCK_D"], wrap)
    else:
        delta = lse
    if packed_grad is None:
        operands = Operands.of(q, k, v, kv_offsets, call, arch, grads=(grad_out, dk, dv))
    plan = choose_backward(call, operands)
    # dS[h, kv row, query of its example], rows padded (q stands in, unread, without a buffer: an
    # input, not a tensor the kernel writes, which Inductor may then not write in place)
    ds = _store_ds_buffer(q, k, call.max_q_len) if plan.store_ds else None
    store_ds = ds is not None
    if ds is None:
        ds = q
    gluon = plan.dkdv == "gluon" and store_ds and not fallback.failed("gluon_dkdv", _variant(q, call.activation))
    if gluon:
        qk_scale, grad_scale, dv_scale = call.backward_scales()

        def gluon_dkdv():
            from kernels.jagged_attention import gluon_bwd

            gluon_bwd.dkdv(
                q,
                k,
                v,
                grad_out,
                dk,
                dv,
                ds,
                q_offsets,
                kv_offsets,
                batch_order,
                call.max_kv_len,
                meta["ACTIVATION"],
                qk_scale,
                grad_scale,
                dv_scale,
            )

        variant = _variant(q, call.activation)
        gluon = fallback.guarded("gluon_dkdv", variant, "triton", "kernels.gluon_bwd=false", gluon_dkdv)
    if not gluon:
        triton_bwd.dkdv(
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dk,
            dv,
            ds,
            q_offsets,
            kv_offsets,
            batch_order,
            call,
            store_ds,
            meta,
            wrap,
            rope,
            offsets[1:],
        )
    if store_ds:
        triton_bwd.dq_from_ds(ds, k, dq_rows, q_offsets, kv_offsets, batch_order, call, meta, wrap, rope, offsets[0])
    else:
        triton_bwd.dq(
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dq_rows,
            q_offsets,
            kv_offsets,
            batch_order,
            call,
            meta,
            wrap,
            rope,
            offsets[0],
        )
    if call.q_broadcast:
        dq = dq_rows.view(num_batches, q.shape[0], num_heads, head_dim).sum(0).to(q.dtype)
        return (dq, dk, dv) if packed_grad is None else (dq, *packed_grad.unbind(1))
    if packed_grad is not None:
        return packed_grad.unbind(1)
    return dq_rows, dk, dv
