"""Attention pooling of jagged rows by a few learned queries, with keys and values the rows themselves.

``attention_pooling(x [T, D], a [D, Q], offsets [B+1], max_len) -> [B, Q, D]``: per example ``b``
and query column ``q``, ``p = softmax_j(x_j . a_q)`` over the example's rows ``j`` and
``out[b, q] = sum_j p_j x_j`` (an example without rows pools to zeros).

Why: PMA and Kunlun's seed pooling let ``N`` learned queries (``H`` heads of width ``d``) attend to
every row through key and value projections of the whole sequence, ``[T, D] x [D, 2D]``, a large
GEMM (and its two backward GEMMs) to feed ``N`` queries. Softmax attention of a fixed query
against projected keys is a dot product with the row itself::

    q_h . (W_k,h x + b_k,h) = (W_k,h^T q_h) . x + q_h . b_k,h

and the constant ``q_h . b_k,h`` cancels in the softmax; the weights sum to 1, so the value
projection comes after the pooling: ``sum_j p_j (W_v,h x_j + b_v,h) = W_v,h (sum_j p_j x_j) + b_v,h``.
So ``a = scale * W_k^T q`` (``Q = N H`` columns) gives the same output from one pass over the rows,
``4 T D Q`` FLOPs instead of ``4 T D^2 + 4 T D N``; gem.models.sequence.PoolingByAttention applies
``W_v`` and ``b_v`` after it.

The Triton forward runs a program per example and block of query columns (online softmax, float32
accumulators, one read of its rows); the backward a program per example and block of rows, which
writes the rows' gradient once and the scores' gradient ``dS`` for ``da = x^T dS`` (a GEMM).
``backend="reference"`` (the default off CUDA) is the same math in PyTorch on padded rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

from kernels import fallback
from kernels.jagged import jagged_to_padded, offsets_to_lengths
from kernels.jagged_attention.triton_common import (
    INTERPRET,
    OP_WRAP,
    define_op,
    dot,
    fake_without_launch,
    identity,
    resolve_backend,
)

MAX_BLOCK_D = 1024  # wider rows run the reference (the kernels hold a block of rows in registers)


def attention_pooling_reference(x: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    """:func:`attention_pooling` in PyTorch on rows padded to ``max_len``."""
    padded = jagged_to_padded(x, offsets, max_len)  # [B, L, D]
    visible = torch.arange(max_len, device=x.device)[None, :] < offsets_to_lengths(offsets.long())[:, None]
    scores = (padded @ a).masked_fill(~visible[..., None], float("-inf"))  # [B, L, Q]
    weights = torch.softmax(scores, dim=1).nan_to_num(0.0)  # an example without rows: all zero
    return weights.transpose(1, 2) @ padded


@triton.jit
def _pool_fwd_kernel(
    X,
    A,
    OUT,
    LSE,
    offsets,
    num_cols,
    row_dim,
    stride_xt,
    stride_ad,
    stride_ob,
    stride_oq,
    stride_lb,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (q block, example): OUT[b, q] = softmax(X_b A_q)^T X_b and LSE[b, q], streaming the
    example's rows in blocks of BLOCK_T."""
    qs = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    b = tl.program_id(1)
    start = tl.load(offsets + b)
    end = tl.load(offsets + b + 1)
    ds = tl.arange(0, BLOCK_D)
    dmask = ds < row_dim
    qmask = qs < num_cols
    a = tl.load(A + ds[:, None] * stride_ad + qs[None, :], mask=dmask[:, None] & qmask[None, :], other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        rmask = rows < end
        x = tl.load(
            X + rows.to(tl.int64)[:, None] * stride_xt + ds[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
        )
        s = dot(x, a, tl.zeros([BLOCK_T, BLOCK_Q], tl.float32), DOT_PRECISION)
        s = tl.where(rmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[None, :])
        denom = denom * alpha + tl.sum(p, 0)
        acc = dot(tl.trans(p.to(x.dtype)), x, acc * alpha[:, None], DOT_PRECISION)
        m = m_new
    has_rows = denom > 0
    out = acc / tl.where(has_rows, denom, 1.0)[:, None]
    o_ptrs = OUT + b.to(tl.int64) * stride_ob + qs[:, None] * stride_oq + ds[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])
    lse = tl.where(has_rows, m + tl.log(tl.where(has_rows, denom, 1.0)), float("-inf"))
    tl.store(LSE + b * stride_lb + qs, lse, mask=qmask)


@triton.jit
def _queries_and_grad(A, DOUT, b, qs, qmask, ds, dmask, stride_ad, stride_gb, stride_gq, dtype: tl.constexpr):
    """A chunk of the query columns ``A[ds, qs]`` and of example ``b``'s output gradient
    ``DOUT[b, qs, ds]`` (in ``dtype``), zero outside the masks."""
    a = tl.load(A + ds[:, None] * stride_ad + qs[None, :], mask=dmask[:, None] & qmask[None, :], other=0.0)
    g = tl.load(
        DOUT + b.to(tl.int64) * stride_gb + qs[:, None] * stride_gq + ds[None, :],
        mask=qmask[:, None] & dmask[None, :],
        other=0.0,
    )
    return a, g.to(dtype)


@triton.jit
def _pool_bwd_kernel(
    X,
    A,
    DOUT,
    LSE,
    DELTA,
    DX,
    DS,
    offsets,
    num_cols,
    row_dim,
    stride_xt,
    stride_ad,
    stride_gb,
    stride_gq,
    stride_lb,
    stride_dxt,
    stride_dst,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (row block, example), per block of query columns, in two passes over the row's
    width in chunks of BLOCK_D: first the scores ``X A`` and ``dP = X dOUT^T`` (so every dot runs
    over a chunk of the width), then, with ``P = exp(X A - LSE)`` and ``dS = P (dP - DELTA)``,
    ``DX = P dOUT + dS A^T`` chunk by chunk (dots over the block's columns); writes ``DS``. With
    ACCUMULATE (more columns than one block) DX is float32 and each block after the first adds
    to it."""
    b = tl.program_id(1)
    start = tl.load(offsets + b)
    end = tl.load(offsets + b + 1)
    t0 = start + tl.program_id(0) * BLOCK_T
    if t0 >= end:
        return
    rows = t0 + tl.arange(0, BLOCK_T)
    rmask = rows < end
    rows = rows.to(tl.int64)
    dtype = X.dtype.element_ty
    for q0 in range(0, num_cols, BLOCK_Q):
        qs = q0 + tl.arange(0, BLOCK_Q)
        qmask = qs < num_cols
        s = tl.zeros([BLOCK_T, BLOCK_Q], tl.float32)
        dp = tl.zeros([BLOCK_T, BLOCK_Q], tl.float32)
        for d0 in range(0, row_dim, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dmask = ds < row_dim
            x = tl.load(X + rows[:, None] * stride_xt + ds[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            a, g = _queries_and_grad(A, DOUT, b, qs, qmask, ds, dmask, stride_ad, stride_gb, stride_gq, dtype)
            s = dot(x, a, s, DOT_PRECISION)
            dp = dot(x, tl.trans(g), dp, DOT_PRECISION)
        lse = tl.load(LSE + b * stride_lb + qs, mask=qmask, other=0.0)
        delta = tl.load(DELTA + b * stride_lb + qs, mask=qmask, other=0.0)
        p = tl.where(rmask[:, None] & qmask[None, :], tl.exp(s - lse[None, :]), 0.0)
        d_s = p * (dp - delta[None, :])
        tl.store(DS + rows[:, None] * stride_dst + qs[None, :], d_s, mask=rmask[:, None] & qmask[None, :])
        p = p.to(dtype)
        d_s = d_s.to(dtype)
        for d0 in range(0, row_dim, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dmask = ds < row_dim
            a, g = _queries_and_grad(A, DOUT, b, qs, qmask, ds, dmask, stride_ad, stride_gb, stride_gq, dtype)
            dx = dot(p, g, tl.zeros([BLOCK_T, BLOCK_D], tl.float32), DOT_PRECISION)
            dx = dot(d_s, tl.trans(a), dx, DOT_PRECISION)
            dx_ptrs = DX + rows[:, None] * stride_dxt + ds[None, :]
            io_mask = rmask[:, None] & dmask[None, :]
            if ACCUMULATE:
                dx += tl.load(dx_ptrs, mask=io_mask & (q0 > 0), other=0.0)
            tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=io_mask)


def launch_config(kind: str, row_dim: int, num_cols: int) -> dict:
    """Block sizes, warps and stages of the ``"fwd"`` or ``"bwd"`` kernel (the interpreter's are
    small, to cover the loops): the fastest of a sweep on an H200 at gem_base's rows (width 512) for
    16 and 128 query columns (docs/e2e.md, engineering log). The backward's BLOCK_D is its chunk of
    the width, its BLOCK_Q all the columns up to 128."""
    block_d = max(16, triton.next_power_of_2(row_dim))
    if INTERPRET:
        chunk = 16 if kind == "bwd" else block_d
        return dict(BLOCK_T=16, BLOCK_D=chunk, BLOCK_Q=16, num_warps=4, num_stages=1)
    if kind == "fwd":
        return dict(BLOCK_T=64, BLOCK_D=block_d, BLOCK_Q=16 if num_cols <= 16 else 32, num_warps=4, num_stages=2)
    block_q = min(128, max(16, triton.next_power_of_2(num_cols)))
    # 64-row blocks with 64 or more columns stopped on an illegal memory access on the H200
    # (Triton 3.6; the interpreter finds no bad address), so wider column blocks take 32 rows
    return dict(
        BLOCK_T=64 if block_q <= 16 else 32, BLOCK_D=min(64, block_d), BLOCK_Q=block_q, num_warps=4, num_stages=3
    )


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _forward(x, a, offsets, max_len, wrap, config=None):
    row_dim = x.shape[1]
    num_batches, num_cols = offsets.numel() - 1, a.shape[1]
    out = x.new_empty(num_batches, num_cols, row_dim)
    lse = x.new_empty(num_batches, num_cols, dtype=torch.float32)
    if num_batches == 0 or num_cols == 0:
        return out, lse
    config = config or launch_config("fwd", row_dim, num_cols)
    wrap(_pool_fwd_kernel)[(triton.cdiv(num_cols, config["BLOCK_Q"]), num_batches)](
        x,
        a,
        out,
        lse,
        offsets,
        num_cols,
        row_dim,
        x.stride(0),
        a.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        DOT_PRECISION=_precision(x),
        **config,
    )
    return out, lse


def _backward(grad_out, x, a, out, lse, offsets, max_len, wrap, config=None):
    num_rows, row_dim = x.shape
    num_batches, num_cols = offsets.numel() - 1, a.shape[1]
    if num_rows == 0 or num_cols == 0 or max_len == 0:
        return torch.zeros_like(x), torch.zeros_like(a)
    d_scores = x.new_empty(num_rows, num_cols, dtype=torch.float32)
    delta = (out.float() * grad_out.float()).sum(-1)  # [B, Q]: sum_j P dP per query column
    config = config or launch_config("bwd", row_dim, num_cols)
    accumulate = num_cols > config["BLOCK_Q"]  # several column blocks add into a float32 dx
    dx = torch.empty_like(x, dtype=torch.float32 if accumulate else x.dtype)
    wrap(_pool_bwd_kernel)[(triton.cdiv(max_len, config["BLOCK_T"]), num_batches)](
        x,
        a,
        grad_out,
        lse,
        delta,
        dx,
        d_scores,
        offsets,
        num_cols,
        row_dim,
        x.stride(0),
        a.stride(0),
        grad_out.stride(0),
        grad_out.stride(1),
        lse.stride(0),
        dx.stride(0),
        d_scores.stride(0),
        ACCUMULATE=accumulate,
        DOT_PRECISION=_precision(x),
        **config,
    )
    da = x.t() @ d_scores.to(x.dtype)  # [D, Q], float32 accumulation in the GEMM
    return dx.to(x.dtype), da.to(a.dtype)


@define_op("gem_kernels::attention_pooling_fwd")
def _fwd_op(x: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, a, offsets, max_len, OP_WRAP)


@define_op("gem_kernels::attention_pooling_bwd")
def _bwd_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad_out, x, a, out, lse, offsets, max_len, OP_WRAP)


fake_without_launch(_fwd_op, _forward)
fake_without_launch(_bwd_op, _backward)


def _setup_context(ctx, inputs, output) -> None:
    x, a, offsets, max_len = inputs
    out, lse = output
    ctx.save_for_backward(x, a, out, lse, offsets)
    ctx.max_len = max_len


def _grad(ctx, grad_out, grad_lse):
    x, a, out, lse, offsets = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    dx, da = torch.ops.gem_kernels.attention_pooling_bwd(grad_out, x, a, out, lse, offsets, ctx.max_len)
    return dx, da, None, None


torch.library.register_autograd("gem_kernels::attention_pooling_fwd", _grad, setup_context=_setup_context)


def _flops(x, a) -> int:
    """Forward: the scores ``x a`` and the weighted sum, ``2 T D Q`` each."""
    return 4 * x.shape[0] * x.shape[1] * a.shape[1]


@register_flop_formula(torch.ops.gem_kernels.attention_pooling_fwd, get_raw=True)
def _fwd_flop_formula(x, a, *args, out_val=None, **kwargs) -> int:
    return _flops(x, a)


@register_flop_formula(torch.ops.gem_kernels.attention_pooling_bwd, get_raw=True)
def _bwd_flop_formula(grad_out, x, a, *args, out_val=None, **kwargs) -> int:
    # scores and dP recomputed, dX's two products, dA = x^T dS: 2.5 x forward
    return 5 * _flops(x, a) // 2


def attention_pooling(
    x: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, max_len: int, backend: str | None = None
) -> torch.Tensor:
    """Per example, the softmax-weighted sum of its rows for each query column (module docstring).

    Args:
        x: ``[T, D]`` jagged rows (16-bit or float32); a: ``[D, Q]`` query columns, scale included.
        offsets: ``[B+1]`` int32 / int64, the cumulative row counts; max_len: a host-side upper
            bound on the rows of an example (the Triton backward's grid; the reference's padding).
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, the reference elsewhere).
            Rows wider than 1,024 run the reference.

    Returns ``[B, Q, D]`` in ``x``'s dtype, differentiable in ``x`` and ``a``.
    """
    if x.dim() != 2 or a.dim() != 2 or a.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, D] and a [D, Q], got {tuple(x.shape)} and {tuple(a.shape)}")
    if a.dtype != x.dtype:
        raise ValueError(f"x and a dtypes differ: {x.dtype}, {a.dtype}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be [B+1] int32 or int64, got {tuple(offsets.shape)} {offsets.dtype}")
    variant = (fallback.dtype_name(x), x.shape[1], a.shape[1])
    if triton.next_power_of_2(x.shape[1]) > MAX_BLOCK_D or (
        resolve_backend(backend, x, "attention_pooling", variant) == "reference"
    ):
        return attention_pooling_reference(x, a, offsets, max_len)
    x = x if x.stride(1) == 1 else x.contiguous()
    a = a.contiguous()
    out, _ = torch.ops.gem_kernels.attention_pooling_fwd(x, a, offsets, int(max_len))
    return out


def _probe(dtype: str, width: int, num_cols: int, device: int) -> None:
    """Both pooling kernels of a variant, launched once on tiny inputs (kernels.fallback; sizes
    None: gem_base's, width 512 and 16 columns)."""

    width, num_cols = width or 512, num_cols or 16
    x = torch.randn(7, width, device=fallback.device_of(device), dtype=getattr(torch, dtype))
    a = torch.randn(width, num_cols, device=x.device, dtype=x.dtype)
    offsets = torch.tensor([0, 5, 7], device=x.device)
    out, lse = _forward(x, a, offsets, 5, identity)
    _backward(torch.randn_like(out), x, a, out, lse, offsets, 5, identity)


fallback.PROBES["attention_pooling"] = _probe
