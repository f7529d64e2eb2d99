"""The Triton backward of jagged attention: its kernels and their launchers.

Reads top-down: the softmax preprocess (delta), the dK/dV kernel (one program per example, head
and key block, streaming the query blocks that see it; it may also store dS), the dQ kernel
(one program per query block, streaming key blocks, recomputing S and dP) and the dQ-from-dS
kernel (dQ = dS K from the stored dS), then one launcher per kernel. No atomics, so the
gradients are deterministic. Which kernels run (stored dS or not, Triton or Gluon dK/dV) is
``call.py``'s choice; the math is ``reference.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.jagged_attention import autotune
from kernels.jagged_attention.triton_common import (
    BOUNDS,
    UNMASKED,
    VISIBLE,
    bucket,
    dot,
    example_rows,
    gdpa_act_and_grad,
    gdpa_act_and_grad_packed,
    identity,
    key_interval,
    load_rows,
    load_tile,
    program_block,
    query_interval,
    split_blocks,
    store_grad,
    visible_mask,
)

if TYPE_CHECKING:
    from kernels.jagged_attention.call import AttentionCall

# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    num_rows,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_delta_h,
    head_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (softmax only)."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (offs_d < head_dim)[None, :]
    rows64 = rows.to(tl.int64)
    o = tl.load(O + rows64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows64[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + h * stride_delta_h + rows, delta, mask=rows < num_rows)


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    DS,
    stride_qt,
    stride_dot,
    stride_dst,
    cols,
    offs_d,
    dmask,
    start,
    end,
    q_len,
    kv_len,
    qk_scale,
    window,
    block_size,
    MASK: tl.constexpr,
    ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    STORE_DS: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        q = load_tile(Q, stride_qt, m0, rows, q_len, offs_d, dmask, MASK != UNMASKED, EVEN_D)
        do = load_tile(DO, stride_dot, m0, rows, q_len, offs_d, dmask, MASK != UNMASKED, EVEN_D)
        x_t = dot(k, tl.trans(q), None, DOT_PRECISION)  # [N, M] raw scores
        dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)  # [N, M]
        if ACTIVATION == 0:
            s_t = x_t * qk_scale
            if MASK != UNMASKED:  # (rows past the end: p = 0)
                lse = tl.load(LSE + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(DELTA + rows, mask=rows < q_len, other=0.0)
            else:
                lse = tl.load(LSE + rows)
                delta = tl.load(DELTA + rows)
            p_t = tl.math.exp2(s_t - lse[None, :])
            if MASK == VISIBLE:
                vis = visible_mask(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p_t = tl.where(tl.trans(vis), p_t, 0.0)
            ds_t = p_t * (dp_t - delta[None, :])
        else:
            if PACKED_ACT:
                p_t, ds_t = gdpa_act_and_grad_packed(x_t.to(do.dtype), dp_t.to(do.dtype), qk_scale, ACTIVATION)
            else:
                p_t, g_t = gdpa_act_and_grad(x_t, qk_scale, ACTIVATION, DOT_PRECISION != "ieee")
                ds_t = dp_t * g_t
            if MASK == VISIBLE:
                vis_t = tl.trans(
                    visible_mask(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                )
                p_t = tl.where(vis_t, p_t, 0.0)
                ds_t = tl.where(vis_t, ds_t, 0.0)
        ds_t = ds_t.to(q.dtype)
        if STORE_DS:  # [keys, queries] of this example and head (see _bwd_dq_from_ds_kernel);
            # rows past q_len hold zeros (no row mask, so the stores vectorize)
            tl.store(DS + cols.to(tl.int64)[:, None] * stride_dst + rows[None, :], ds_t, mask=(cols < kv_len)[:, None])
        dv = dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dk = dot(ds_t, q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["max_kv_len", "window", "block_size"])
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DS,
    COS,
    SIN,
    q_offsets,
    kv_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lse_h,
    stride_dsh,
    stride_dst,
    stride_cs,
    dk_offset,
    dv_offset,
    num_heads,
    head_dim,
    max_kv_len,
    qk_scale,
    dk_scale,
    dv_scale,
    window,
    block_size,
    max_q_bucket,
    max_kv_bucket,
    ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    Q_BROADCAST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    STORE_DS: tl.constexpr,
    ROPE: tl.constexpr,
    DV_IN_DK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK and dV of one (example, head, key block), written at DK + dk_offset and DV + dv_offset
    (elements; DK + dv_offset with DV_IN_DK; see :func:`dkdv`). With ROPE, K and Q are the rotated
    operands and dK is turned back through the rotation as it is stored (``triton_common.store_grad``)."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dk_scale = tl.cast(dk_scale, tl.float32)
    dv_scale = tl.cast(dv_scale, tl.float32)
    n_block, rank, h = program_block(tl.program_id(0), max_kv_len, BLOCK_N, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1)
    )
    n0 = n_block * BLOCK_N
    if n0 >= kv_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    k = load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    v = load_rows(V + cols[:, None] * stride_vt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    Q += q_start * stride_qt + h * stride_qh
    DO += o_start * stride_dot + h * stride_doh
    LSE += h * stride_lse_h + o_start
    DELTA += h * stride_lse_h + o_start
    DS += h.to(tl.int64) * stride_dsh + kv_start * stride_dst

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        j_last = tl.minimum(n0 + BLOCK_N, kv_len) - 1
        lo_any, lo_all, hi_all, hi_any = query_interval(
            n0, j_last, q_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        first, full_start, full_end, last = split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_M)
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            DS,
            stride_qt,
            stride_dot,
            stride_dst,
            cols,
            offs_d,
            dmask,
            first,
            full_start,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            VISIBLE,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_M,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
            False,
        )
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            DS,
            stride_qt,
            stride_dot,
            stride_dst,
            cols,
            offs_d,
            dmask,
            full_start,
            full_end,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            UNMASKED,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_M,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
            False,
        )
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            DS,
            stride_qt,
            stride_dot,
            stride_dst,
            cols,
            offs_d,
            dmask,
            full_end,
            last,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            VISIBLE,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_M,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
            False,
        )
    else:  # dS is stored on this path only (STORE_DS)
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            DS,
            stride_qt,
            stride_dot,
            stride_dst,
            cols,
            offs_d,
            dmask,
            0,
            q_len,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            BOUNDS,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_M,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
            STORE_DS,
        )

    col_mask = cols < kv_len
    if DV_IN_DK:  # one packed gradient: a kernel may write one argument only, under torch.compile
        DV = DK + dv_offset + kv_start * stride_dvt + h * stride_dvh
    else:
        DV += dv_offset + kv_start * stride_dvt + h * stride_dvh
    DK += dk_offset + kv_start * stride_dkt + h * stride_dkh
    table_rows = kv_start + cols
    store_grad(
        DK, cols, stride_dkt, offs_d, col_mask, dmask, dk * dk_scale, COS, SIN, table_rows, stride_cs, ROPE, BLOCK_D
    )
    store_grad(
        DV, cols, stride_dvt, offs_d, col_mask, dmask, dv * dv_scale, COS, SIN, table_rows, stride_cs, False, BLOCK_D
    )


@triton.jit
def _bwd_dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    stride_kt,
    stride_vt,
    rows,
    offs_d,
    dmask,
    start,
    end,
    q_len,
    kv_len,
    qk_scale,
    window,
    block_size,
    MASK: tl.constexpr,
    ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = load_tile(K, stride_kt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D)
        v = load_tile(V, stride_vt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D)
        x = dot(q, tl.trans(k), None, DOT_PRECISION)  # [M, N] raw scores
        dp = dot(do, tl.trans(v), None, DOT_PRECISION)  # [M, N]
        if ACTIVATION == 0:
            p = tl.math.exp2(x * qk_scale - lse[:, None])
            if MASK == BOUNDS:  # a key past the end scores 0: exp2(-lse) overflows for lse < -128
                p = tl.where((cols < kv_len)[None, :], p, 0.0)
            ds = p * (dp - delta[:, None])
        else:
            if PACKED_ACT:
                ds = gdpa_act_and_grad_packed(x.to(k.dtype), dp.to(k.dtype), qk_scale, ACTIVATION)[1]
            else:
                ds = dp * gdpa_act_and_grad(x, qk_scale, ACTIVATION, DOT_PRECISION != "ieee")[1]
        if MASK == VISIBLE:  # (keys past the end: k = 0, so a finite ds there adds nothing)
            vis = visible_mask(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
            ds = tl.where(vis, ds, 0.0)
        dq = dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    COS,
    SIN,
    q_offsets,
    kv_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lse_h,
    stride_cs,
    dq_offset,
    num_heads,
    head_dim,
    max_q_len,
    qk_scale,
    dq_scale,
    window,
    block_size,
    max_q_bucket,
    max_kv_bucket,
    ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    Q_BROADCAST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of one (example, head, query block), recomputing S and dP, written at DQ + dq_offset;
    ROPE as _bwd_dkdv_kernel's."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dq_scale = tl.cast(dq_scale, tl.float32)
    m_block, rank, h = program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1)
    )
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    row_mask = rows < q_len
    Q += q_start * stride_qt + h * stride_qh
    DO += o_start * stride_dot + h * stride_doh
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    q = load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    do = load_rows(DO + rows[:, None] * stride_dot + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    if ACTIVATION == 0:
        lse = tl.load(LSE + h * stride_lse_h + o_start + rows, mask=row_mask, other=float("inf"))
        delta = tl.load(DELTA + h * stride_lse_h + o_start + rows, mask=row_mask, other=0.0)
    else:
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        delta = lse

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
        lo_any, lo_all, hi_all, hi_any = key_interval(
            m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        first, full_start, full_end, last = split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
        dq = _bwd_dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kt,
            stride_vt,
            rows,
            offs_d,
            dmask,
            first,
            full_start,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            VISIBLE,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_N,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
        )
        dq = _bwd_dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kt,
            stride_vt,
            rows,
            offs_d,
            dmask,
            full_start,
            full_end,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            UNMASKED,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_N,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
        )
        dq = _bwd_dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kt,
            stride_vt,
            rows,
            offs_d,
            dmask,
            full_end,
            last,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            VISIBLE,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_N,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
        )
    else:
        dq = _bwd_dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kt,
            stride_vt,
            rows,
            offs_d,
            dmask,
            0,
            kv_len,
            q_len,
            kv_len,
            qk_scale,
            window,
            block_size,
            BOUNDS,
            ACTIVATION,
            CAUSAL,
            HAS_WINDOW,
            HAS_BLOCK,
            BLOCK_N,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
        )

    DQ += dq_offset + o_start * stride_dqt + h * stride_dqh
    store_grad(
        DQ, rows, stride_dqt, offs_d, row_mask, dmask, dq * dq_scale, COS, SIN, o_start + rows, stride_cs, ROPE, BLOCK_D
    )


@triton.jit(do_not_specialize=["max_q_len"])
def _bwd_dq_from_ds_kernel(
    DS,
    K,
    DQ,
    COS,
    SIN,
    q_offsets,
    kv_offsets,
    batch_order,
    stride_dsh,
    stride_dst,
    stride_kt,
    stride_kh,
    stride_dqt,
    stride_dqh,
    stride_cs,
    dq_offset,
    num_heads,
    head_dim,
    max_q_len,
    dq_scale,
    max_q_bucket,
    max_kv_bucket,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ = dS K (STORE_DS): one program per (example, head, query block), as _bwd_dq_kernel,
    but reading the dS that _bwd_dkdv_kernel stored (``DS[h, kv row, query]``: a key's row of
    its example's queries) instead of recomputing S and dP. Keys past the example's end are
    masked; queries are not (so the loads vectorize): the rows are padded to a multiple of
    every BLOCK_M, and a query past the end only reaches its own dQ row, which is not stored.
    dq_offset and ROPE as _bwd_dq_kernel's."""
    dq_scale = tl.cast(dq_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    m_block, rank, h = program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1)
    )
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    row_mask = rows < q_len
    DS += h.to(tl.int64) * stride_dsh + kv_start * stride_dst
    K += kv_start * stride_kt + h * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        cols = n0 + offs_n
        ds_t = tl.load(
            DS + cols.to(tl.int64)[:, None] * stride_dst + rows[None, :], mask=(cols < kv_len)[:, None], other=0.0
        )
        k = load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
        dq = dot(tl.trans(ds_t), k, dq, DOT_PRECISION)

    DQ += dq_offset + o_start * stride_dqt + h * stride_dqh
    store_grad(
        DQ, rows, stride_dqt, offs_d, row_mask, dmask, dq * dq_scale, COS, SIN, o_start + rows, stride_cs, ROPE, BLOCK_D
    )


# ---------------------------------------------------------------------------------------
# launchers (arguments as in triton_fwd.forward; ``meta``: triton_common.launch_meta's)
# ---------------------------------------------------------------------------------------


def _tables(rope, dummy) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cos, sin, row stride)`` of the rotary tables, or a stand-in (unread) without them: an
    input, never a tensor the kernel writes (an argument aliasing a written one could keep
    Inductor from writing that one in place)."""
    if rope is None:
        return dummy, dummy, 0
    cos, sin = rope
    return cos, sin, cos.stride(0)


def preprocess(
    out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, block_d: int, wrap=identity
) -> torch.Tensor:
    """Softmax only: ``delta [H, To]`` float32, the row sums of ``dO * O``."""
    num_rows, num_heads, head_dim = out.shape
    delta = torch.empty_like(lse)
    block_t = 64
    wrap(_bwd_preprocess_kernel)[(triton.cdiv(num_rows, block_t), num_heads)](
        out,
        grad_out,
        delta,
        num_rows,
        out.stride(0),
        out.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        delta.stride(0),
        head_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    return delta


def dkdv(
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
    call: AttentionCall,
    store_ds,
    meta,
    wrap=identity,
    rope=None,
    offsets=(0, 0),
) -> None:
    """Writes dK and dV (and, where ``store_ds``, dS into ``ds``: ``[H, K/V rows, padded
    queries]``; without it ``ds`` is any tensor, unused). ``rope``: ``(cos, sin)`` where Q and K
    are rotated and dK is to be turned back through the rotation (``triton_common.store_grad``).
    ``offsets``: elements from ``dk`` and ``dv``'s data to their first row, for gradients written
    into slices of one buffer, which is then passed as both ``dk`` and ``dv`` (and written through
    ``dk`` only). Under torch.compile a kernel's written argument must be a whole buffer (2.11's
    functionalization clones a written view with an offset out of bounds, pytorch#192226), and
    only one argument may name it (functionalization clones each written argument on its own, so
    writes through another could be lost). Lengths, scales (``call.backward_scales``), mask and
    settings from ``call``."""
    num_batches, num_heads, head_dim = kv_offsets.numel() - 1, q.shape[1], q.shape[2]
    max_q_len, max_kv_len = call.max_q_len, call.max_kv_len
    qk_scale, grad_scale, dv_scale = call.backward_scales()
    cos, sin, stride_cs = _tables(rope, q)
    packed = dv is dk  # written through DK (DV_IN_DK); the DV argument is a stand-in, unread
    dv_arg = q if packed else dv
    lse_stride = lse.stride(0) if meta["ACTIVATION"] == 0 else 0
    kernel, launch = autotune.kernel_and_config(
        _bwd_dkdv_kernel, "dkdv", meta["BLOCK_D"], q.element_size(), call.settings
    )

    def grid(cfg):
        return (triton.cdiv(max_kv_len, cfg["BLOCK_N"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv_arg,
        ds,
        cos,
        sin,
        q_offsets,
        kv_offsets,
        batch_order,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),  # (dk's where packed)
        dv.stride(1),
        lse_stride,
        ds.stride(0),
        ds.stride(1),
        stride_cs,
        *offsets,
        num_heads,
        head_dim,
        max_kv_len,
        qk_scale,
        grad_scale,
        dv_scale,
        call.window,
        call.block_size,
        bucket(max_q_len),
        bucket(max_kv_len),
        **meta,
        STORE_DS=store_ds,
        ROPE=rope is not None,
        DV_IN_DK=packed,
        **launch,
    )


def dq(
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
    call: AttentionCall,
    meta,
    wrap=identity,
    rope=None,
    offset=0,
) -> None:
    """Writes dQ into ``dq_rows`` (``[To, H, D]``, from element ``offset``), recomputing S and dP;
    ``call``, ``rope`` and ``offset`` as :func:`dkdv`'s."""
    num_batches, num_heads, head_dim = kv_offsets.numel() - 1, q.shape[1], q.shape[2]
    max_q_len, max_kv_len = call.max_q_len, call.max_kv_len
    qk_scale, grad_scale, _ = call.backward_scales()
    cos, sin, stride_cs = _tables(rope, q)
    lse_stride = lse.stride(0) if meta["ACTIVATION"] == 0 else 0
    kernel, launch = autotune.kernel_and_config(_bwd_dq_kernel, "dq", meta["BLOCK_D"], q.element_size(), call.settings)

    def grid(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dq_rows,
        cos,
        sin,
        q_offsets,
        kv_offsets,
        batch_order,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        dq_rows.stride(0),
        dq_rows.stride(1),
        lse_stride,
        stride_cs,
        offset,
        num_heads,
        head_dim,
        max_q_len,
        qk_scale,
        grad_scale,
        call.window,
        call.block_size,
        bucket(max_q_len),
        bucket(max_kv_len),
        **meta,
        ROPE=rope is not None,
        **launch,
    )


def dq_from_ds(
    ds,
    k,
    dq_rows,
    q_offsets,
    kv_offsets,
    batch_order,
    call: AttentionCall,
    meta,
    wrap=identity,
    rope=None,
    offset=0,
) -> None:
    """Writes dQ = dS K into ``dq_rows`` (from element ``offset``) from the dS that the dK/dV
    kernel stored; ``call``, ``rope`` and ``offset`` as :func:`dkdv`'s."""
    num_batches, num_heads, head_dim = kv_offsets.numel() - 1, k.shape[1], k.shape[2]
    max_q_len, max_kv_len = call.max_q_len, call.max_kv_len
    grad_scale = call.backward_scales()[1]
    cos, sin, stride_cs = _tables(rope, k)
    kernel, launch = autotune.kernel_and_config(
        _bwd_dq_from_ds_kernel, "dq_ds", meta["BLOCK_D"], k.element_size(), call.settings
    )

    def grid(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        ds,
        k,
        dq_rows,
        cos,
        sin,
        q_offsets,
        kv_offsets,
        batch_order,
        ds.stride(0),
        ds.stride(1),
        k.stride(0),
        k.stride(1),
        dq_rows.stride(0),
        dq_rows.stride(1),
        stride_cs,
        offset,
        num_heads,
        head_dim,
        max_q_len,
        grad_scale,
        bucket(max_q_len),
        bucket(max_kv_len),
        BLOCK_D=meta["BLOCK_D"],
        EVEN_D=meta["EVEN_D"],
        DOT_PRECISION=meta["DOT_PRECISION"],
        ROPE=rope is not None,
        **launch,
    )
