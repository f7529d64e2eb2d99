"""Rotary position embedding of a packed Q/K/V projection, forward and backward in one Triton kernel each.

``rotary_qkv(qkv [T, 3, H, D], cos, sin) -> (q, k, v)``, each ``[T, H, D]``: Q and K rotated by
the per-row tables, V copied out. The channel pairs are ``(j, j + D/2)`` (the "rotate half" form)::

    q[..., :D/2] = x1 cos - x2 sin        q[..., D/2:] = x1 sin + x2 cos

Why a kernel: the layers project Q, K and V with one GEMM and the attention kernels read them as
separate tensors. Compiled as plain PyTorch, the backward of ``unbind`` (a stack) and of the
rotation become one Inductor kernel at about twice its memory floor (0.7 ms a layer at gem_base
shapes on an H200, docs/e2e.md); here the backward reads dQ, dK, dV once and writes the packed
gradient ``d qkv`` once. V is copied in the forward so that its gradient joins the same write:
a view of the input would send it through a separate ``select`` backward and a sum.

``backend="reference"`` (the default off CUDA) is the same math in PyTorch. The tables are float32;
the kernels compute in float32 and round once. :func:`rotate_qk` (Q and K only, no autograd) is the
forward of ``kernels.jagged_attention.rotary_self_attention``'s fused path, whose attention kernels
read V in place and turn the gradients back themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fallback
from kernels.jagged_attention.triton_common import OP_WRAP, define_op, fake_without_launch, resolve_backend

BLOCK_T = 16  # rows per program: 16 x 3 x H x D elements (24,576 at 4 heads x 128)


def rotary_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rotary_qkv` in PyTorch (the tables cast to ``qkv``'s dtype)."""
    q, k, v = qkv.unbind(1)
    cos, sin = (t.to(qkv.dtype)[:, None, :] for t in (cos, sin))

    def rotate(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    return rotate(q), rotate(k), v


@triton.jit
def _rotate(X, Y, row_x, row_y, cos, sin, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    """Y = R X on one [rows, D] tile of a head (R^T X with INVERSE); row_x / row_y: element offsets."""
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    x1 = tl.load(X + row_x + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + row_x + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        y1, y2 = x1 * cos + x2 * sin, x2 * cos - x1 * sin
    else:
        y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    tl.store(Y + row_y + cols, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + row_y + HALF + cols, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _copy(X, Y, row_x, row_y, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    tl.store(Y + row_y + cols, tl.load(X + row_x + cols, mask=mask), mask=mask)
    tl.store(Y + row_y + HALF + cols, tl.load(X + row_x + HALF + cols, mask=mask), mask=mask)


@triton.jit
def _rotary_kernel(
    QKV,
    Q,
    K,
    V,
    COS,
    SIN,
    num_rows,
    num_heads,
    stride_qkv_t,
    stride_qkv_c,
    stride_qkv_h,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cs,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BACKWARD: tl.constexpr,
    COPY_V: tl.constexpr,
):
    """Forward: Q, K, V = rotate(QKV[:, 0]), rotate(QKV[:, 1]), QKV[:, 2] (V only with COPY_V).
    Backward (BACKWARD): QKV[:, 0], QKV[:, 1], QKV[:, 2] = rotate^T(Q), rotate^T(K), V (Q, K, V
    hold the gradients)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (rows < num_rows)[:, None] & (tl.arange(0, BLOCK_HALF) < HALF)[None, :]
    rows = rows.to(tl.int64)[:, None]
    table = rows * stride_cs + tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    for h in range(num_heads):
        packed = rows * stride_qkv_t + h * stride_qkv_h
        q_row = rows * stride_q_t + h * stride_q_h
        k_row = rows * stride_k_t + h * stride_k_h
        v_row = rows * stride_v_t + h * stride_v_h
        if BACKWARD:
            _rotate(Q, QKV, q_row, packed, cos, sin, mask, HALF, BLOCK_HALF, True)
            _rotate(K, QKV, k_row, packed + stride_qkv_c, cos, sin, mask, HALF, BLOCK_HALF, True)
            _copy(V, QKV, v_row, packed + 2 * stride_qkv_c, mask, HALF, BLOCK_HALF)
        else:
            _rotate(QKV, Q, packed, q_row, cos, sin, mask, HALF, BLOCK_HALF, False)
            _rotate(QKV, K, packed + stride_qkv_c, k_row, cos, sin, mask, HALF, BLOCK_HALF, False)
            if COPY_V:
                _copy(QKV, V, packed + 2 * stride_qkv_c, v_row, mask, HALF, BLOCK_HALF)


def _launch(qkv, q, k, v, cos, sin, backward: bool, wrap, copy_v: bool = True) -> None:
    num_rows, _, num_heads, head_dim = qkv.shape
    if num_rows == 0 or num_heads == 0:
        return
    half = head_dim // 2
    wrap(_rotary_kernel)[(triton.cdiv(num_rows, BLOCK_T),)](
        qkv,
        q,
        k,
        v,
        cos,
        sin,
        num_rows,
        num_heads,
        qkv.stride(0),
        qkv.stride(1),
        qkv.stride(2),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_T=BLOCK_T,
        BACKWARD=backward,
        COPY_V=copy_v,
        num_warps=4,
    )


def _forward(qkv, cos, sin, wrap):
    shape = (qkv.shape[0], qkv.shape[2], qkv.shape[3])
    q, k, v = (qkv.new_empty(shape) for _ in range(3))
    _launch(qkv, q, k, v, cos, sin, False, wrap)
    return q, k, v


def rotate_qk(qkv, cos, sin, wrap) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K of ``qkv [T, 3, H, D]`` rotated, each ``[T, H, D]`` (no autograd): the forward of
    ``kernels.jagged_attention.rotary_self_attention``, whose kernels read V from ``qkv`` and
    turn the gradients of Q and K back through the rotation themselves."""
    shape = (qkv.shape[0], qkv.shape[2], qkv.shape[3])
    q, k = qkv.new_empty(shape), qkv.new_empty(shape)
    _launch(qkv, q, k, qkv, cos, sin, False, wrap, copy_v=False)  # (V: a stand-in, unread)
    return q, k


def _backward(dq, dk, dv, cos, sin, wrap):
    dqkv = dq.new_empty(dq.shape[0], 3, *dq.shape[1:])
    _launch(dqkv, dq, dk, dv, cos, sin, True, wrap)
    return dqkv


@define_op("gem_kernels::rotary_qkv_fwd")
def _fwd_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(qkv, cos, sin, OP_WRAP)


@define_op("gem_kernels::rotary_qkv_bwd")
def _bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _backward(dq, dk, dv, cos, sin, OP_WRAP)


fake_without_launch(_fwd_op, _forward)
fake_without_launch(_bwd_op, _backward)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _grad(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
    return torch.ops.gem_kernels.rotary_qkv_bwd(dq, dk, dv, cos, sin), None, None


torch.library.register_autograd("gem_kernels::rotary_qkv_fwd", _grad, setup_context=_setup_context)


def check_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """A ValueError naming the argument unless ``qkv`` is ``[T, 3, H, D]`` with D even and
    ``cos, sin`` are float32 ``[T, D/2]``."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be [T, 3, H, D], got {tuple(qkv.shape)}")
    num_rows, _, _, head_dim = qkv.shape
    if head_dim % 2:
        raise ValueError(f"rotary embeddings rotate channel pairs: head dim {head_dim} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_rows, head_dim // 2):
            raise ValueError(f"{name} must be [T, D/2] = [{num_rows}, {head_dim // 2}], got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")


def rotary_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` ``[T, H, D]`` from a packed projection ``qkv [T, 3, H, D]``: Q and K rotated
    by ``cos, sin [T, D/2]`` (float32, the angle of each row's position), V as is.

    Args:
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, the reference elsewhere).
            Triton needs ``qkv``'s last dimension contiguous and an even head dim; the tables
            need their last dimension contiguous.

    Differentiable in ``qkv`` (the tables take no gradient).
    """
    check_inputs(qkv, cos, sin)
    if resolve_backend(backend, qkv, "rotary_qkv", (fallback.dtype_name(qkv), qkv.shape[-1])) == "reference":
        return rotary_reference(qkv, cos, sin)
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return torch.ops.gem_kernels.rotary_qkv_fwd(qkv, cos, sin)


def _probe(dtype: str, head_dim: int, device: int) -> None:
    """Both rotary kernels of a variant, launched once on tiny inputs (kernels.fallback; head dim None: 128)."""
    from kernels.jagged_attention.triton_common import identity

    head_dim = head_dim or 128
    qkv = torch.randn(5, 3, 1, head_dim, device=fallback.device_of(device), dtype=getattr(torch, dtype))
    angles = torch.randn(5, head_dim // 2, device=qkv.device)
    cos, sin = angles.cos(), angles.sin()
    _backward(*_forward(qkv, cos, sin, identity), cos, sin, identity)


fallback.PROBES["rotary_qkv"] = _probe
