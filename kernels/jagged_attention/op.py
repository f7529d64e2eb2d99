"""torch.library registration of the Triton jagged attention: ops, autograd, FLOP formulas.

Two ops in the ``gem_kernels`` namespace, both ``triton_op`` so that ``torch.compile`` sees
the Triton kernels inside them (no graph break) and a ``FlopCounterMode`` counts them:

* ``gem_kernels::jagged_attention_fwd(...) -> (out, lse, batch_order)``
* ``gem_kernels::jagged_attention_bwd(grad_out, ...) -> (dq, dk, dv)``

The forward computes the order in which the kernels' programs take the examples
(``triton.batch_order``) and returns it for the backward.

Callers use :func:`kernels.jagged_attention`, which normalizes layouts and calls
:func:`jagged_attention_triton` below.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton
from torch.utils.flop_counter import register_flop_formula

from kernels.jagged_attention import triton as tk
from kernels.jagged_attention.reference import num_visible_pairs


if tk.INTERPRET:
    # Interpreted kernels cannot be traced into a graph (wrap_triton hands them back raw),
    # so under TRITON_INTERPRET=1 the same ops are opaque custom ops with a fake impl.
    def _define(name):
        return torch.library.custom_op(name, mutates_args=())

    def _wrap(kernel):  # launch the interpreted kernels directly
        return kernel
else:
    def _define(name):
        return triton_op(name, mutates_args=())

    _wrap = wrap_triton


# The ops take their scalars packed: sizes = [max_q_len, max_kv_len, causal, window, block_size,
# q_broadcast] and scales = [scale, post_scale]. PyTorch's autograd path for custom ops
# (torch._library.utils.fill_defaults) costs time quadratic in the number of schema arguments:
# 50 us per forward call with them unpacked (15 arguments), 16 packed (8), timed alone on a CPU.
# With that and the batch order computed inside the forward op (one op call less), a whole
# forward call (launches replaced by no-ops) went from 180 to 125 us.
def _unpack(sizes: list[int], activation: str, scales: list[float]) -> tuple:
    """The launchers' scalar arguments (``max_q_len`` to ``q_broadcast``) from the packed ones."""
    max_q_len, max_kv_len, causal, window, block_size, q_broadcast = sizes
    return (max_q_len, max_kv_len, activation, scales[0], scales[1], bool(causal), window,
            block_size, bool(q_broadcast))


def _forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, wrap):
    """(out, lse, batch_order): the forward, and the order its programs took the examples in
    (longest first), which the backward's take too."""
    batch_order = tk.batch_order(q_offsets, kv_offsets, wrap=wrap)
    out, lse = tk.jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, batch_order,
                                       *_unpack(sizes, activation, scales), wrap=wrap)
    return out, lse, batch_order


@_define("gem_kernels::jagged_attention_fwd")
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor, sizes: list[int], activation: str, scales: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, q_offsets, kv_offsets, sizes, activation, scales, _wrap)


def _backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order, sizes,
                      activation, scales, wrap):
    return tk.jagged_attention_bwd(grad_out, q, k, v, out, lse, q_offsets, kv_offsets,
                                   batch_order, *_unpack(sizes, activation, scales), wrap=wrap)


@_define("gem_kernels::jagged_attention_bwd")
def _bwd_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
    batch_order: torch.Tensor, sizes: list[int], activation: str, scales: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order,
                             sizes, activation, scales, _wrap)


if tk.INTERPRET:
    @_fwd_op.register_fake
    def _fwd_fake(*args):
        return _forward(*args, wrap=tk.no_launch)

    @_bwd_op.register_fake
    def _bwd_fake(*args):
        return _backward_kernels(*args, wrap=tk.no_launch)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, *params = inputs
    out, lse, batch_order = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, batch_order)
    ctx.params = params  # sizes, activation, scales


def _backward(ctx, grad_out, grad_lse, grad_order):
    q, k, v, out, lse, q_offsets, kv_offsets, batch_order = ctx.saved_tensors
    dq, dk, dv = torch.ops.gem_kernels.jagged_attention_bwd(
        grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order, *ctx.params
    )
    return dq, dk, dv, None, None, *([None] * len(ctx.params))


torch.library.register_autograd(
    "gem_kernels::jagged_attention_fwd", _backward, setup_context=_setup_context
)


def _forward_flops(q, kv_offsets, q_offsets, sizes) -> int:
    """4 * H * D * (visible pairs on the true jagged lengths); an upper bound under tracing."""
    max_q_len, max_kv_len, causal, window, block_size, _ = sizes
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_batches = kv_offsets.shape[0] - 1
    try:
        q_lengths = q_offsets[1:] - q_offsets[:-1]
        kv_lengths = kv_offsets[1:] - kv_offsets[:-1]
        pairs = num_visible_pairs(q_lengths, kv_lengths, causal,
                                  window if window >= 0 else None,
                                  block_size if block_size > 0 else None)
    except Exception:  # fake / meta tensors carry no lengths: count the padded bound
        pairs = num_batches * max_q_len * max_kv_len
    return 4 * num_heads * head_dim * pairs


@register_flop_formula(torch.ops.gem_kernels.jagged_attention_fwd, get_raw=True)
def _fwd_flop_formula(q, k, v, q_offsets, kv_offsets, sizes, *args, out_val=None,
                      **kwargs) -> int:
    return _forward_flops(q, kv_offsets, q_offsets, sizes)


@register_flop_formula(torch.ops.gem_kernels.jagged_attention_bwd, get_raw=True)
def _bwd_flop_formula(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, batch_order, sizes,
                      *args, out_val=None, **kwargs) -> int:
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (+ S recomputed): 2.5 x forward.
    return 5 * _forward_flops(q, kv_offsets, q_offsets, sizes) // 2


def jagged_attention_triton(
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation, scale, post_scale,
    causal, window, block_size, q_broadcast,
) -> torch.Tensor:
    """Calls the registered forward op (differentiable); arguments as in ``triton.py``."""
    out, _, _ = torch.ops.gem_kernels.jagged_attention_fwd(
        q, k, v, q_offsets, kv_offsets,
        [max_q_len, max_kv_len, int(causal), window, block_size, int(q_broadcast)], activation,
        [scale, post_scale],
    )
    return out
