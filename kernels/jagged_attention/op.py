"""torch.library registration of the jagged attention kernels: which kernels run, autograd, FLOPs.

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

This module chooses the kernels, from the settings in force (``settings.py``) and the inputs:

* forward (:func:`launch_forward`): the Gluon GDPA forward (``gluon_fwd.py``) where it applies
  and ``max_q_len > settings.gluon_min_q_len``, else the Triton one (``triton_fwd.py``);
* backward (:func:`launch_backward`): the stored-dS backward where it applies and its buffer
  fits (:func:`store_ds_bytes`, ``settings.store_ds_max_mib``; dK/dV store dS, dQ = dS K reads
  it), its dK/dV in Gluon (``gluon_bwd.py``) for bf16 silu / fast_gelu on sm_90; else the
  Triton dK/dV and the recomputing dQ kernel (``triton_bwd.py``).

The forward computes the order in which the kernels' programs take the examples
(``batch_order.py``) and returns it for the backward. Callers use
:func:`kernels.jagged_attention` and :func:`kernels.jagged_attention.rotary_self_attention`, which
validate, normalize layouts and call :func:`jagged_attention_triton` /
:func:`rotary_self_attention_triton` below.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import triton
from torch.utils.flop_counter import register_flop_formula

from kernels import fallback, rotary  # (modules: kernels.rotary imports this package's triton_common)
from kernels.jagged_attention import settings as kernel_settings
from kernels.jagged_attention import triton_bwd, triton_fwd
from kernels.jagged_attention.batch_order import batch_order
from kernels.jagged_attention.reference import num_visible_pairs
from kernels.jagged_attention.settings import KernelSettings
from kernels.jagged_attention.settings import current as current_settings
from kernels.jagged_attention.triton_common import (
    ACT_UNIT,
    INTERPRET,
    LOG2E,
    OP_WRAP,
    define_op,
    fake_without_launch,
    identity,
    launch_meta,
    no_launch,
    packed_act,
    unmasked,
    unmasked_pointwise,
)

# Test-facing (``testing.record_paths``): where not None, each launch appends the kernels it
# chose ("gluon_fwd", "triton_fwd", "gluon_dkdv", "triton_dkdv", "dq_from_ds", "dq").
_paths: list | None = None


def _took(path: str) -> None:
    if _paths is not None:
        _paths.append(path)


@contextlib.contextmanager
def probing(gluon: bool = False):
    """Around a build check's tiny calls, with no launch recorded in ``_paths``: the Triton
    kernels only (``kernels.fallback.triton_usable``; the Gluon ones fall back where they run), or
    with ``gluon`` the kernels the settings in force choose (``kernels.fallback.gluon_checked``)."""
    global _paths
    saved_paths, saved = _paths, current_settings()
    _paths = None
    if not gluon:
        kernel_settings._set(saved.replace(gluon=False, gluon_bwd=False))
    try:
        yield
    finally:
        _paths = saved_paths
        kernel_settings._set(saved)


# ---------------------------------------------------------------------------------------
# the kernels' choice and launch (no autograd)
# ---------------------------------------------------------------------------------------


# The Triton releases (major.minor) on which each Gluon kernel passed the GPU gate
# (tools/gpu_gate.sh, benchmarks/results/gpu-gate.json); on any other the Triton kernels run, with
# one info line. A release joins a kernel's list only with a passing gate on it.
GLUON_VERIFIED = {"gluon_fwd": ("3.6",), "gluon_dkdv": ("3.6",)}
_allow_unverified = False  # testing.unverified_gluon(): a new release's GPU tests run the kernels


def gluon_verified(kernel: str) -> bool:
    """Whether this Triton release is in ``GLUON_VERIFIED[kernel]``."""
    return _allow_unverified or _release_verified(kernel, ".".join(triton.__version__.split(".")[:2]))


@functools.cache
def _release_verified(kernel: str, release: str) -> bool:
    if release in GLUON_VERIFIED[kernel]:
        return True
    logging.getLogger(__name__).info(
        "the Gluon kernel %s has not passed the GPU gate on Triton %s (only on %s): the Triton kernels run instead",
        kernel,
        release,
        ", ".join(GLUON_VERIFIED[kernel]) or "none yet",
    )
    return False


def _gluon_applies(q, k, v, activation, causal, window, block_size, q_broadcast) -> bool:
    """Whether the Gluon forward can take the call (``gluon_common.applies``), on a verified Triton."""
    if INTERPRET or not q.is_cuda or not gluon_verified("gluon_fwd"):
        return False
    from kernels.jagged_attention import gluon_common

    return gluon_common.applies(q, k, v, activation, causal, window, block_size, q_broadcast)


def _variant(q, activation: str) -> str:
    """A Gluon launch's kernel variant, as its fallback is recorded: what its build depends on."""
    return f"{activation} {fallback.dtype_name(q)} D={q.shape[-1]}"


def launch_forward(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    batch_order,
    max_q_len,
    max_kv_len,
    activation,
    scale,
    post_scale,
    causal,
    window,
    block_size,
    q_broadcast,
    *,
    wrap=identity,
    config: KernelSettings | None = None,
    arch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the forward; arguments as ``triton_fwd.forward``'s. ``config`` (default:
    the settings in force) and ``arch`` (a compute capability standing in for q's device's, e.g.
    ``(9, 0)`` to compile for Hopper without one) are for tools that compile the kernels."""
    config = config or current_settings()
    packed = packed_act(q, activation, config, arch)
    meta = launch_meta(q, activation, causal, window, block_size, q_broadcast, packed)
    num_batches = kv_offsets.numel() - 1
    num_rows = num_batches * q.shape[0] if q_broadcast else q.shape[0]
    empty = num_rows == 0 or q.shape[1] == 0 or num_batches == 0  # the Triton launcher's zeros
    if (
        not empty
        and config.gluon
        and activation != "softmax"
        and max_q_len > config.gluon_min_q_len
        and _gluon_applies(q, k, v, activation, causal, window, block_size, q_broadcast)
        and not fallback.failed("gluon_fwd", _variant(q, activation))
    ):
        out = q.new_empty(q.shape)

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
                max_q_len,
                meta["ACTIVATION"],
                scale,
                triton_fwd.output_scale(activation, scale, post_scale),
                packed,
            )

        if fallback.guarded("gluon_fwd", _variant(q, activation), "triton", "kernels.gluon=false", gluon):
            _took("gluon_fwd")
            return out, q.new_empty((1,), dtype=torch.float32)  # (lse: a placeholder, unread by GDPA)
    _took("triton_fwd")
    return triton_fwd.forward(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        batch_order,
        max_q_len,
        max_kv_len,
        activation,
        scale,
        post_scale,
        window,
        block_size,
        q_broadcast,
        meta,
        config,
        wrap,
    )


def store_ds_row(max_q_len: int) -> int:
    """Elements per row of the stored-dS buffer: ``max_q_len`` rounded up to a multiple of 128,
    which every BLOCK_M divides, so that whole query blocks fit (``_bwd_dq_from_ds_kernel``)."""
    return triton.cdiv(max(int(max_q_len), 1), 128) * 128


def store_ds_bytes(q, k, max_q_len, causal, window, block_size, q_broadcast) -> int:
    """Bytes of the stored-dS buffer, ``H x (K/V rows) x store_ds_row(max_q_len)`` elements, or 0
    where the stored-dS backward does not apply (a causal, window or block mask, whose dK/dV
    kernel skips tiles; a broadcast Q)."""
    if not unmasked(causal, window, block_size, q_broadcast):
        return 0
    return q.shape[1] * k.shape[0] * store_ds_row(max_q_len) * q.element_size()


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


def _gluon_dkdv(
    q, k, v, grad_out, dk, dv, packed_grad, activation, mask, store_ds, packed, rotated, config
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (dK, dV) that gluon_bwd's dK/dV kernel writes (storing dS too) where it runs the
    backward's dK/dV, else None: the stored-dS backward in bf16 silu / fast_gelu (the bf16x2
    path, unrotated) with ``config.gluon_bwd``, where the Gluon kernels apply to q, k, v and dO,
    dK and dV can be addressed as q. ``mask``: (causal, window, block_size, q_broadcast). A packed
    gradient's dK and dV are its slices (views: this path runs on real tensors only, never
    traced by torch.compile)."""
    if not (config.gluon_bwd and packed and not rotated and store_ds and not INTERPRET and q.is_cuda):
        return None
    if not gluon_verified("gluon_dkdv"):
        return None
    from kernels.jagged_attention import gluon_common

    if not gluon_common.applies(q, k, v, activation, *mask) or fallback.failed("gluon_dkdv", _variant(q, activation)):
        return None
    if packed_grad is not None:
        dk, dv = packed_grad.unbind(1)[-2:]
    return (dk, dv) if all(gluon_common.addressable(t) for t in (grad_out, dk, dv)) else None


def launch_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    q_offsets,
    kv_offsets,
    batch_order,
    max_q_len,
    max_kv_len,
    activation,
    scale,
    post_scale,
    causal,
    window,
    block_size,
    q_broadcast,
    *,
    wrap=identity,
    config: KernelSettings | None = None,
    arch: tuple[int, int] | None = None,
    packed_grad: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` shaped like ``q, k, v``; arguments as :func:`launch_forward`, ``grad_out``
    shaped like ``out``. With ``q_broadcast``, dQ is computed per example in float32 and summed
    over the batch. The Triton kernels can write the gradient of a packed projection whole:
    ``packed_grad`` ``[T, 3, H, D]`` receives dQ, dK and dV in its three slices for self-attention
    (Q, K and V on the same rows), ``[T, 2, H, D]`` dK and dV with a broadcast Q; the parts are
    returned as its views. ``rope`` ``(cos, sin)`` (self-attention) says Q and K are the rotated
    operands, whose gradients are turned back through the rotation as they are stored (head dim a
    power of 2)."""
    config = config or current_settings()
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = out.shape[0]
    packed = packed_act(q, activation, config, arch)
    meta = launch_meta(q, activation, causal, window, block_size, q_broadcast, packed)
    parts = 2 if q_broadcast else 3  # of a packed gradient
    if packed_grad is not None and packed_grad.shape[1] != parts:
        raise ValueError(
            f"packed_grad must be [T, {parts}, H, D] ({'dK, dV' if q_broadcast else 'dQ, dK, dV'}), "
            f"got {tuple(packed_grad.shape)}"
        )
    if rope is not None and q_broadcast:
        raise ValueError("rope is for self-attention: jagged Q, K and V on the same rows")
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
    if q_broadcast:
        dq_rows = q.new_empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    elif packed_grad is not None:
        dq_rows = dk
    else:
        dq_rows = torch.empty_like(q)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or max_q_len == 0 or max_kv_len == 0:
        if packed_grad is None:
            return torch.zeros_like(q), dk.zero_(), dv.zero_()
        packed_grad.zero_()
        return packed_grad.unbind(1) if parts == 3 else (torch.zeros_like(q), *packed_grad.unbind(1))
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()

    if activation == "softmax":
        delta = triton_bwd.preprocess(out, grad_out, lse, meta["BLOCK_D"], wrap)
        qk_scale, grad_scale, dv_scale = scale * LOG2E, scale, 1.0
    else:
        delta = lse
        # The kernels' activation factors leave out unit * scale (value) and unit (gradient).
        unit = ACT_UNIT[activation]
        qk_scale, grad_scale, dv_scale = scale, scale * post_scale * unit, post_scale * unit * scale

    store_ds = (
        config.store_ds
        and 0 < store_ds_bytes(q, k, max_q_len, causal, window, block_size, q_broadcast) <= config.store_ds_max_bytes
    )
    # dS[h, kv row, query of its example], rows padded (q stands in, unread, without a buffer: an
    # input, not a tensor the kernel writes, which Inductor may then not write in place)
    ds = _store_ds_buffer(q, k, max_q_len) if store_ds else None
    store_ds = ds is not None
    if ds is None:
        ds = q
    mask = (causal, window, block_size, q_broadcast)
    gluon_grads = _gluon_dkdv(
        q, k, v, grad_out, dk, dv, packed_grad, activation, mask, store_ds, packed, rope is not None, config
    )
    if gluon_grads is not None:

        def gluon():
            from kernels.jagged_attention import gluon_bwd

            gluon_bwd.dkdv(
                q,
                k,
                v,
                grad_out,
                *gluon_grads,
                ds,
                q_offsets,
                kv_offsets,
                batch_order,
                max_kv_len,
                meta["ACTIVATION"],
                qk_scale,
                grad_scale,
                dv_scale,
            )

        if not fallback.guarded("gluon_dkdv", _variant(q, activation), "triton", "kernels.gluon_bwd=false", gluon):
            gluon_grads = None
    if gluon_grads is not None:
        _took("gluon_dkdv")
    else:
        _took("triton_dkdv")
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
            max_q_len,
            max_kv_len,
            qk_scale,
            grad_scale,
            dv_scale,
            window,
            block_size,
            store_ds,
            meta,
            config,
            wrap,
            rope,
            offsets[1:],
        )
    if store_ds:
        _took("dq_from_ds")
        triton_bwd.dq_from_ds(
            ds,
            k,
            dq_rows,
            q_offsets,
            kv_offsets,
            batch_order,
            max_q_len,
            max_kv_len,
            grad_scale,
            meta,
            config,
            wrap,
            rope,
            offsets[0],
        )
    else:
        _took("dq")
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
            max_q_len,
            max_kv_len,
            qk_scale,
            grad_scale,
            window,
            block_size,
            meta,
            config,
            wrap,
            rope,
            offsets[0],
        )
    if q_broadcast:
        dq = dq_rows.view(num_batches, q.shape[0], num_heads, head_dim).sum(0).to(q.dtype)
        return (dq, dk, dv) if packed_grad is None else (dq, *packed_grad.unbind(1))
    if packed_grad is not None:
        return packed_grad.unbind(1)
    return dq_rows, dk, dv


# ---------------------------------------------------------------------------------------
# the registered ops
# ---------------------------------------------------------------------------------------


# The ops take their scalars packed: sizes = [max_q_len, max_kv_len, causal, window, block_size,
# q_broadcast] and scales = [scale, post_scale] (fewer schema arguments cost less per call in
# PyTorch's custom-op autograd path; measured in docs/log/kernels.md).
def _unpack(sizes: list[int], activation: str, scales: list[float]) -> tuple:
    """The launchers' scalar arguments (``max_q_len`` to ``q_broadcast``) from the packed ones."""
    max_q_len, max_kv_len, causal, window, block_size, q_broadcast = sizes
    return (
        max_q_len,
        max_kv_len,
        activation,
        scales[0],
        scales[1],
        bool(causal),
        window,
        block_size,
        bool(q_broadcast),
    )


def _forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, wrap):
    """(out, lse, batch_order): the forward, and the order its programs took the examples in
    (longest first), which the backward's take too."""
    order = batch_order(q_offsets, kv_offsets, wrap=wrap)
    out, lse = launch_forward(q, k, v, q_offsets, kv_offsets, order, *_unpack(sizes, activation, scales), wrap=wrap)
    return out, lse, order


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
        return _forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, wrap)

    return forward


def _backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, sizes, activation, scales, wrap):
    return launch_backward(
        grad_out, q, k, v, out, lse, q_offsets, kv_offsets, order, *_unpack(sizes, activation, scales), wrap=wrap
    )


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
fake_without_launch(_fwd_op, _forward)
fake_without_launch(_bwd_op, _backward_kernels)
_define_opaque_pair("jagged_attention", _forward_op, _backward_op, _forward, _backward_kernels)


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
    max_q_len, max_kv_len, causal, window, block_size, _ = sizes
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
    out, lse, order = _forward(q, k, qkv[:, 2], offsets, offsets, sizes, activation, scales, wrap)
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
    launch_backward(
        grad_out,
        q,
        k,
        qkv[:, 2],
        out,
        lse,
        offsets,
        offsets,
        order,
        *_unpack(sizes, activation, scales),
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


@register_flop_formula(torch.ops.gem_kernels.rotary_self_attention_fwd, get_raw=True)
def _rope_fwd_flop_formula(qkv, cos, sin, offsets, sizes, *args, out_val=None, **kwargs) -> int:
    return _forward_flops(qkv[:, 0], offsets, offsets, sizes)


@register_flop_formula(torch.ops.gem_kernels.rotary_self_attention_bwd, get_raw=True)
def _rope_bwd_flop_formula(
    grad_out, q, k, qkv, out, lse, cos, sin, offsets, batch_order, sizes, *args, **kwargs
) -> int:
    return 5 * _forward_flops(q, offsets, offsets, sizes) // 2


# ---------------------------------------------------------------------------------------
# broadcast queries over a packed K/V projection: the gradient of kv written whole
# ---------------------------------------------------------------------------------------


def _kv_forward(q, kv, q_offsets, kv_offsets, sizes, activation, scales, wrap):
    """(out, lse, batch_order), K and V read from ``kv [T, 2, H, D]`` in place."""
    return _forward(q, kv[:, 0], kv[:, 1], q_offsets, kv_offsets, sizes, activation, scales, wrap)


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
    dq, _, _ = launch_backward(
        grad_out,
        q,
        kv[:, 0],
        kv[:, 1],
        out,
        lse,
        q_offsets,
        kv_offsets,
        order,
        *_unpack(sizes, activation, scales),
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


def packed_kv_attention_triton(q, kv, q_offsets, kv_offsets, max_kv_len, scale) -> torch.Tensor:
    """Calls the registered op: softmax attention of the broadcast ``q [N, H, D]`` (``q_offsets``: N
    rows an example) over each example's rows of ``kv``; ``[B * N, H, D]``, differentiable in ``q``
    and ``kv``."""
    out, _, _ = torch.ops.gem_kernels.packed_kv_attention_fwd(
        q, kv, q_offsets, kv_offsets, [q.shape[0], max_kv_len, 0, -1, 0, 1], "softmax", [scale, 1.0]
    )
    return out


def rotary_self_attention_triton(qkv, cos, sin, offsets, max_len, scale, causal, window) -> torch.Tensor:
    """Calls the registered rotary self-attention op (softmax, differentiable in ``qkv``)."""
    out, _, _, _, _ = torch.ops.gem_kernels.rotary_self_attention_fwd(
        qkv, cos, sin, offsets, [max_len, max_len, int(causal), window, 0, 0], "softmax", [scale, 1.0]
    )
    return out


def jagged_attention_triton(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    activation,
    scale,
    post_scale,
    causal,
    window,
    block_size,
    q_broadcast,
) -> torch.Tensor:
    """Calls the registered forward op (differentiable); arguments as in ``triton_fwd.forward``.
    Under ``torch.compile`` with ``settings.gluon_compiled``, a call the Gluon kernels may take (a
    pointwise activation, no mask, jagged queries) goes to the opaque op instead, which decides
    on the real tensors, as an eager call does; its Gluon kernels are launched once while Dynamo
    traces (``fallback.gluon_checked``), so that one that fails to build falls back there."""
    opaque = (
        unmasked_pointwise(activation, causal, window, block_size, q_broadcast)
        and torch.compiler.is_compiling()
        and current_settings().gluon_compiled
    )
    if opaque and q.is_cuda and isinstance(q.shape[-1], int):
        fallback.gluon_checked("gluon_gdpa", (activation, fallback.dtype_name(q), q.shape[-1], q.device.index or 0))
    fwd_op = torch.ops.gem_kernels.jagged_attention_fwd_eager if opaque else torch.ops.gem_kernels.jagged_attention_fwd
    out, _, _ = fwd_op(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        [max_q_len, max_kv_len, int(causal), window, block_size, int(q_broadcast)],
        activation,
        [scale, post_scale],
    )
    return out
