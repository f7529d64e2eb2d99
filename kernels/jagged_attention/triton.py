"""Triton kernels for jagged attention (Jagged Flash Attention and GDPA) and their launchers.

Reads top-down: ``@triton.jit`` helpers and kernels (forward, backward preprocess, dK/dV,
dQ), then the launchers that check inputs, allocate outputs and compute grids. The
autograd function and the torch.library registration live in ``op.py``; the math is
specified by ``reference.py``.

One program handles one (example, head, row block). Every mask (jagged length, causal,
sliding window, BlockAttention) keeps, for each query row, one contiguous interval of keys,
so each program visits only the key blocks that intersect the union of its rows'
intervals: blocks visible to every row run without any mask, the few border blocks run
masked. BlockAttention and sliding window therefore cost O(length), not O(length^2).
Programs are ordered longest example first (``batch_order``), so the short and empty
examples fill the tail of the grid instead of leaving long ones to run alone.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.reference import ACTIVATIONS

# Activation codes passed to the kernels as a constexpr.
SOFTMAX, SILU, GELU, FAST_GELU, RELU, IDENTITY = range(6)
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    """GEM_KERNELS_AUTOTUNE (default 1 on GPU): time a few configs per bucketed shape key.

    With 0, the per-head-dim default config below is launched directly (no tuning runs);
    the interpreter always uses one small config.
    """
    return not INTERPRET and os.environ.get("GEM_KERNELS_AUTOTUNE", "1") == "1"


# Triton 3.7's interpreter gets bf16 tl.dot wrong; there every dot runs on float32 copies of
# its (already rounded) operands, which keeps the numerics of the compiled kernel.
_UPCAST_DOTS = tl.constexpr(INTERPRET)

LOG2E = 1.4426950408889634
SQRT_2_OVER_PI = 0.7978845608028654
INV_SQRT_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327


# ---------------------------------------------------------------------------------------
# @triton.jit helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with a float32 accumulator."""
    if _UPCAST_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh; FAST uses the hardware approximation (MUFU.TANH, rel. error ~5e-4, 16-bit inputs)."""
    if FAST and not _UPCAST_DOTS:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _activation(s, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """act(s) for the pointwise (GDPA) activations; s is float32."""
    if ACTIVATION == 1:  # silu: s * sigmoid(s) = 0.5 s (1 + tanh(s / 2))
        half_s = 0.5 * s
        return half_s + half_s * _tanh(half_s, FAST)
    elif ACTIVATION == 2:  # gelu (erf)
        return 0.5 * s * (1.0 + tl.erf(s * 0.7071067811865476))
    elif ACTIVATION == 3:  # fast_gelu: 0.5 s (1 + tanh(u))
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        half_s = 0.5 * s
        return half_s + half_s * _tanh(u, FAST)
    elif ACTIVATION == 4:  # relu
        return tl.maximum(s, 0.0)
    else:  # identity
        return s


@triton.jit
def _activation_grad(s, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """d act(s) / ds for the pointwise activations; s is float32."""
    if ACTIVATION == 1:  # silu: sig (1 + s (1 - sig)), sig = 0.5 (1 + tanh(s / 2))
        sig = 0.5 + 0.5 * _tanh(0.5 * s, FAST)
        return sig * (1.0 + s * (1.0 - sig))
    elif ACTIVATION == 2:  # gelu: Phi(s) + s phi(s)
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * s * s)
        return cdf + s * pdf
    elif ACTIVATION == 3:  # fast_gelu: 0.5 (1 + t) + 0.5 s (1 - t^2) du/ds, t = tanh(u)
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        t = _tanh(u, FAST)
        du = 0.7978845608028654 * (1.0 + 0.134145 * s * s)
        return 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * du
    elif ACTIVATION == 4:  # relu
        return tl.where(s > 0.0, 1.0, 0.0)
    else:  # identity
        return s * 0.0 + 1.0


@triton.jit
def _visible(
    rows, cols, num_rows, num_cols, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """[len(rows), len(cols)] mask of visible (query row, key col) pairs."""
    i = rows[:, None]
    j = cols[None, :]
    mask = (i < num_rows) & (j < num_cols)
    if CAUSAL:
        mask = mask & (j <= i)
    if HAS_WINDOW:
        mask = mask & (i - j <= window) & (j - i <= window)
    if HAS_BLOCK:
        mask = mask & ((i // block_size) == (j // block_size))
    return mask


@triton.jit
def _key_interval(
    i_first, i_last, num_keys, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """Keys visible to queries i_first..i_last: [lo_any, hi_any) to some, [lo_all, hi_all) to all."""
    lo_any = num_keys * 0
    lo_all = num_keys * 0
    hi_any = num_keys
    hi_all = num_keys
    if CAUSAL:
        hi_any = tl.minimum(hi_any, i_last + 1)
        hi_all = tl.minimum(hi_all, i_first + 1)
    if HAS_WINDOW:
        lo_any = tl.maximum(lo_any, i_first - window)
        lo_all = tl.maximum(lo_all, i_last - window)
        hi_any = tl.minimum(hi_any, i_last + window + 1)
        hi_all = tl.minimum(hi_all, i_first + window + 1)
    if HAS_BLOCK:
        lo_any = tl.maximum(lo_any, (i_first // block_size) * block_size)
        lo_all = tl.maximum(lo_all, (i_last // block_size) * block_size)
        hi_any = tl.minimum(hi_any, (i_last // block_size + 1) * block_size)
        hi_all = tl.minimum(hi_all, (i_first // block_size + 1) * block_size)
    return lo_any, lo_all, hi_all, hi_any


@triton.jit
def _query_interval(
    j_first, j_last, num_queries, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """Queries that see keys j_first..j_last: [lo_any, hi_any) see some, [lo_all, hi_all) all."""
    lo_any = num_queries * 0
    lo_all = num_queries * 0
    hi_any = num_queries
    hi_all = num_queries
    if CAUSAL:
        lo_any = tl.maximum(lo_any, j_first)
        lo_all = tl.maximum(lo_all, j_last)
    if HAS_WINDOW:
        lo_any = tl.maximum(lo_any, j_first - window)
        lo_all = tl.maximum(lo_all, j_last - window)
        hi_any = tl.minimum(hi_any, j_last + window + 1)
        hi_all = tl.minimum(hi_all, j_first + window + 1)
    if HAS_BLOCK:
        lo_any = tl.maximum(lo_any, (j_first // block_size) * block_size)
        lo_all = tl.maximum(lo_all, (j_last // block_size) * block_size)
        hi_any = tl.minimum(hi_any, (j_last // block_size + 1) * block_size)
        hi_all = tl.minimum(hi_all, (j_first // block_size + 1) * block_size)
    return lo_any, lo_all, hi_all, hi_any


@triton.jit
def _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK: tl.constexpr):
    """Splits [lo_any, hi_any) into masked [first, full_start), unmasked [full_start, full_end)
    (whole blocks inside [lo_all, hi_all)) and masked [full_end, hi_any)."""
    first = (lo_any // BLOCK) * BLOCK
    full_start = tl.minimum(tl.cdiv(lo_all, BLOCK) * BLOCK, hi_any)
    full_start = tl.maximum(full_start, first)
    num_full = tl.maximum(hi_all - full_start, 0) // BLOCK
    full_end = full_start + num_full * BLOCK
    return first, full_start, full_end, hi_any


@triton.jit
def _load_rows(ptrs, rows, num_rows, dmask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=(rows < num_rows)[:, None], other=0.0)
        return tl.load(ptrs, mask=(rows < num_rows)[:, None] & dmask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=dmask[None, :], other=0.0)


# ---------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASKED: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, MASKED, EVEN_D)
        v = _load_rows(V + cols[:, None] * stride_vt + offs_d[None, :], cols, kv_len, dmask, MASKED, EVEN_D)
        s = _dot(q, tl.trans(k), None, DOT_PRECISION) * qk_scale  # [M, N]
        if ACTIVATION == 0:  # online softmax, log2 domain
            if MASKED:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = _activation(s, ACTIVATION, DOT_PRECISION != "ieee")
            if MASKED:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p = tl.where(vis, p, 0.0)
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _fwd_kernel(
    Q, K, V, O, LSE, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, num_heads, head_dim, max_q_len, qk_scale, post_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(max_q_len, BLOCK_M)
    m_block = pid % num_q_blocks
    bh = pid // num_q_blocks
    b = tl.load(batch_order + bh // num_heads)
    h = bh % num_heads
    o_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - o_start).to(tl.int32)
    kv_start = tl.load(kv_offsets + b).to(tl.int64)
    kv_len = (tl.load(kv_offsets + b + 1) - kv_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    Q += q_start * stride_qt + h * stride_qh
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    q = _load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
    lo_any, lo_all, hi_all, hi_any = _key_interval(
        m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
    first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, first, full_start,
        q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_start, full_end,
        q_len, kv_len, qk_scale, window, block_size, False, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_end, last,
        q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)

    row_mask = rows < q_len
    if ACTIVATION == 0:
        seen = l_i > 0.0
        acc = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        tl.store(LSE + h * stride_lse_h + o_start + rows, lse, mask=row_mask)
    else:
        acc = acc * post_scale
    O += o_start * stride_ot + h * stride_oh
    o_ptrs = O + rows[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, num_rows, stride_ot, stride_oh, stride_dot, stride_doh, stride_delta_h,
    head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
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
    dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, cols, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASKED: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        q = _load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, MASKED, EVEN_D)
        do = _load_rows(DO + rows[:, None] * stride_dot + offs_d[None, :], rows, q_len, dmask, MASKED, EVEN_D)
        s_t = _dot(k, tl.trans(q), None, DOT_PRECISION) * qk_scale  # [N, M]
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [N, M]
        if ACTIVATION == 0:
            if MASKED:
                lse = tl.load(LSE + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(DELTA + rows, mask=rows < q_len, other=0.0)
            else:
                lse = tl.load(LSE + rows)
                delta = tl.load(DELTA + rows)
            p_t = tl.math.exp2(s_t - lse[None, :])
            if MASKED:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p_t = tl.where(tl.trans(vis), p_t, 0.0)
            ds_t = p_t * (dp_t - delta[None, :])
        else:
            p_t = _activation(s_t, ACTIVATION, DOT_PRECISION != "ieee")
            ds_t = dp_t * _activation_grad(s_t, ACTIVATION, DOT_PRECISION != "ieee")
            if MASKED:
                vis_t = tl.trans(_visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK))
                p_t = tl.where(vis_t, p_t, 0.0)
                ds_t = tl.where(vis_t, ds_t, 0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["max_kv_len", "window", "block_size"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    num_heads, head_dim, max_kv_len, qk_scale, dk_scale, dv_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_kv_blocks = tl.cdiv(max_kv_len, BLOCK_N)
    n_block = pid % num_kv_blocks
    bh = pid // num_kv_blocks
    b = tl.load(batch_order + bh // num_heads)
    h = bh % num_heads
    o_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - o_start).to(tl.int32)
    kv_start = tl.load(kv_offsets + b).to(tl.int64)
    kv_len = (tl.load(kv_offsets + b + 1) - kv_start).to(tl.int32)
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
    k = _load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    v = _load_rows(V + cols[:, None] * stride_vt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    Q += q_start * stride_qt + h * stride_qh
    DO += o_start * stride_dot + h * stride_doh
    LSE += h * stride_lse_h + o_start
    DELTA += h * stride_lse_h + o_start

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    j_last = tl.minimum(n0 + BLOCK_N, kv_len) - 1
    lo_any, lo_all, hi_all, hi_any = _query_interval(
        n0, j_last, q_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
    first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_M)
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, cols, offs_d, dmask, first,
        full_start, q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL,
        HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION)
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, cols, offs_d, dmask, full_start,
        full_end, q_len, kv_len, qk_scale, window, block_size, False, ACTIVATION, CAUSAL,
        HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION)
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, cols, offs_d, dmask, full_end,
        last, q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL,
        HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION)

    col_mask = (cols < kv_len)[:, None] & dmask[None, :]
    DK += kv_start * stride_dkt + h * stride_dkh
    DV += kv_start * stride_dvt + h * stride_dvh
    tl.store(DK + cols[:, None] * stride_dkt + offs_d[None, :], (dk * dk_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + cols[:, None] * stride_dvt + offs_d[None, :], (dv * dv_scale).to(DV.dtype.element_ty), mask=col_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASKED: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, MASKED, EVEN_D)
        v = _load_rows(V + cols[:, None] * stride_vt + offs_d[None, :], cols, kv_len, dmask, MASKED, EVEN_D)
        s = _dot(q, tl.trans(k), None, DOT_PRECISION) * qk_scale  # [M, N]
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)  # [M, N]
        if ACTIVATION == 0:
            p = tl.math.exp2(s - lse[:, None])
            ds = p * (dp - delta[:, None])
        else:
            ds = dp * _activation_grad(s, ACTIVATION, DOT_PRECISION != "ieee")
        if MASKED:
            vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
            ds = tl.where(vis, ds, 0.0)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    num_heads, head_dim, max_q_len, qk_scale, dq_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(max_q_len, BLOCK_M)
    m_block = pid % num_q_blocks
    bh = pid // num_q_blocks
    b = tl.load(batch_order + bh // num_heads)
    h = bh % num_heads
    o_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - o_start).to(tl.int32)
    kv_start = tl.load(kv_offsets + b).to(tl.int64)
    kv_len = (tl.load(kv_offsets + b + 1) - kv_start).to(tl.int32)
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
    q = _load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    do = _load_rows(DO + rows[:, None] * stride_dot + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    if ACTIVATION == 0:
        lse = tl.load(LSE + h * stride_lse_h + o_start + rows, mask=row_mask, other=float("inf"))
        delta = tl.load(DELTA + h * stride_lse_h + o_start + rows, mask=row_mask, other=0.0)
    else:
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        delta = lse

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
    lo_any, lo_all, hi_all, hi_any = _key_interval(
        m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
    first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, first, full_start,
        q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_start, full_end,
        q_len, kv_len, qk_scale, window, block_size, False, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_end, last,
        q_len, kv_len, qk_scale, window, block_size, True, ACTIVATION, CAUSAL, HAS_WINDOW,
        HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION)

    DQ += o_start * stride_dqt + h * stride_dqh
    dq_ptrs = DQ + rows[:, None] * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * dq_scale).to(DQ.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


# ---------------------------------------------------------------------------------------
# launch configurations
# ---------------------------------------------------------------------------------------


def _default_config(kind: str, block_d: int, elem_bytes: int = 2) -> dict:
    """Block sizes, warps and stages per kernel kind and padded head dim, used when
    autotuning is off (GEM_KERNELS_AUTOTUNE=0) and for head dims above 128.

    fp32 inputs (``elem_bytes=4``) take the backward tiles of the next larger head dim: an
    earlier 16-bit dK/dV tile (64 x 128) needed 262,656 bytes of shared memory in fp32 at head
    dim 128, over the H200's 232,448 (measured: OutOfResources)."""
    if INTERPRET:  # small tiles keep the interpreter fast and exercise multi-block paths
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if elem_bytes >= 4 and kind != "fwd" and block_d > 64:
        block_d = 2 * block_d
    if kind == "fwd":
        if block_d <= 64:
            return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
        if block_d <= 128:
            return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    if kind == "dkdv":  # BLOCK_N: key rows held; BLOCK_M: query rows streamed
        if block_d <= 128:
            return dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1)
    # dq: BLOCK_M query rows held; BLOCK_N key rows streamed
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)


# Autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for head dims up to 128: the
# configs the wide search below picked on an H200 for the benchmark's shapes (bf16, D=128;
# benchmarks/results/attention-h200.json, "tuned_configs").
_TUNE_SPACE = {
    "fwd": [(128, 32, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3)],
    "dkdv": [(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2)],
    "dq": [(128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 4, 3)],
}
# GEM_KERNELS_TUNE_SPACE=wide: a larger search for benchmarks and for choosing the list above
# (about three times the tuning time at each new shape bucket).
_WIDE_EXTRA = {
    "fwd": [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3),
            (64, 64, 4, 4)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)],
}
if os.environ.get("GEM_KERNELS_TUNE_SPACE", "default") == "wide":
    _TUNE_SPACE = {kind: space + _WIDE_EXTRA[kind] for kind, space in _TUNE_SPACE.items()}
_TUNE_KEY = ["max_q_bucket", "max_kv_bucket", "BLOCK_D", "ACTIVATION", "CAUSAL", "HAS_WINDOW",
             "HAS_BLOCK", "Q_BROADCAST"]


def _tuned(kernel, kind: str):
    """The kernel under triton.autotune; head dims above 128 and the fp32 backward get their one
    default config."""
    if INTERPRET:
        return kernel
    configs = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s)
               for m, n, w, s in _TUNE_SPACE[kind]]

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 128))
        q = named_args.get("Q")
        elem_bytes = q.element_size() if hasattr(q, "element_size") else 2
        if block_d <= 128 and (elem_bytes < 4 or kind == "fwd"):
            return configs
        # Head dims above 128, and the fp32 backward (whose 16-bit candidates overflow shared memory
        # at head dim 128), launch their one default config.
        launch = dict(_default_config(kind, block_d, elem_bytes))
        warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
        return [triton.Config(launch, num_warps=warps, num_stages=stages)]

    return triton.autotune(configs=configs, key=_TUNE_KEY,
                           prune_configs_by={"early_config_prune": prune})(kernel)


_KERNELS = {
    "fwd": (_fwd_kernel, _tuned(_fwd_kernel, "fwd")),
    "dkdv": (_bwd_dkdv_kernel, _tuned(_bwd_dkdv_kernel, "dkdv")),
    "dq": (_bwd_dq_kernel, _tuned(_bwd_dq_kernel, "dq")),
}


def _kernel_and_config(kind: str, block_d: int, elem_bytes: int = 2):
    """(kernel, launch kwargs): the autotuned kernel, or the plain one with its default."""
    plain, tuned = _KERNELS[kind]
    if autotune_enabled():
        return tuned, {}
    return plain, _default_config(kind, block_d, elem_bytes)


def _bucket(n: int) -> int:
    """Autotune key bucket: the next power of two (a new batch never retunes)."""
    return triton.next_power_of_2(max(int(n), 16))


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


class _NoLaunch:
    """Stands in for a kernel when only output shapes are wanted (fake / meta tensors)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def no_launch(kernel) -> _NoLaunch:
    """A ``wrap`` for the launchers that allocates outputs but launches nothing."""
    return _NoLaunch()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_meta(q, activation, causal, window, block_size, q_broadcast):
    head_dim = q.shape[-1]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    return dict(
        ACTIVATION=ACTIVATION_CODES[activation], CAUSAL=bool(causal), HAS_WINDOW=window >= 0,
        HAS_BLOCK=block_size > 0, Q_BROADCAST=bool(q_broadcast), BLOCK_D=block_d,
        EVEN_D=block_d == head_dim, DOT_PRECISION=_dot_precision(q.dtype),
    )


def jagged_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor, batch_order: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, scale: float, post_scale: float, causal: bool, window: int,
    block_size: int, q_broadcast: bool, wrap=lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel.

    Args:
        q: ``[Tq, H, D]`` (or ``[N, H, D]`` when ``q_broadcast``), last dim contiguous.
        k, v: ``[Tkv, H, D]``, last dim contiguous.
        q_offsets: ``[B+1]`` output row offsets (``arange(B+1) * N`` when ``q_broadcast``).
        kv_offsets: ``[B+1]``.
        batch_order: ``[B]`` int32, examples in the order programs take them (longest first).
        window / block_size: ``-1`` / ``0`` when unused.
        wrap: ``torch.library.wrap_triton`` inside a triton_op, identity otherwise.

    Returns:
        out ``[To, H, D]`` in ``q.dtype`` and, for softmax, lse ``[H, To]`` float32 in log2
        units (``+inf`` for a query that sees no key); a 1-element placeholder otherwise.
    """
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = num_batches * q.shape[0] if q_broadcast else q.shape[0]
    out = q.new_empty(num_rows, num_heads, head_dim)
    softmax = activation == "softmax"
    lse = q.new_empty((num_heads, num_rows) if softmax else (1,), dtype=torch.float32)
    meta = _common_meta(q, activation, causal, window, block_size, q_broadcast)
    kernel, launch = _kernel_and_config("fwd", meta["BLOCK_D"])
    qk_scale = scale * LOG2E if softmax else scale

    if num_rows == 0 or num_heads == 0 or max_q_len == 0 or num_batches == 0:
        return out.zero_(), lse.fill_(float("inf"))

    def grid(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        q, k, v, out, lse, q_offsets, kv_offsets, batch_order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), num_rows, num_heads, head_dim, max_q_len,
        qk_scale, post_scale, window, block_size, _bucket(max_q_len), _bucket(max_kv_len),
        **meta, **launch,
    )
    return out, lse


def jagged_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
    batch_order: torch.Tensor, max_q_len: int, max_kv_len: int, activation: str, scale: float,
    post_scale: float, causal: bool, window: int, block_size: int, q_broadcast: bool,
    wrap=lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the backward kernels; arguments as in :func:`jagged_attention_fwd`.

    ``grad_out`` is ``[To, H, D]`` like ``out``. Returns ``dq, dk, dv`` shaped like
    ``q, k, v``. dK/dV come from one program per (example, head, key block) that streams
    the query blocks seeing it; dQ from one program per query block that streams the key
    blocks (no atomics, so the result is deterministic). With ``q_broadcast``, dQ is
    computed per example in float32 and summed over the batch.
    """
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = out.shape[0]
    softmax = activation == "softmax"
    meta = _common_meta(q, activation, causal, window, block_size, q_broadcast)
    # Every row of an example is written by the kernels (an empty example has no rows).
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if q_broadcast:
        dq_rows = q.new_empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    else:
        dq_rows = torch.empty_like(q)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or max_q_len == 0 or max_kv_len == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()

    if softmax:
        delta = torch.empty_like(lse)  # [H, To]
        block_t = 64
        wrap(_bwd_preprocess_kernel)[(triton.cdiv(num_rows, block_t), num_heads)](
            out, grad_out, delta, num_rows, out.stride(0), out.stride(1), grad_out.stride(0),
            grad_out.stride(1), delta.stride(0), head_dim, BLOCK_T=block_t,
            BLOCK_D=meta["BLOCK_D"],
        )
        qk_scale, grad_scale, dv_scale = scale * LOG2E, scale, 1.0
        lse_stride = lse.stride(0)
    else:
        delta = lse
        qk_scale, grad_scale, dv_scale = scale, scale * post_scale, post_scale
        lse_stride = 0

    def grid_dkdv(cfg):
        return (triton.cdiv(max_kv_len, cfg["BLOCK_N"]) * num_batches * num_heads,)

    kernel, launch = _kernel_and_config("dkdv", meta["BLOCK_D"], q.element_size())
    wrap(kernel)[grid_dkdv](
        q, k, v, grad_out, lse, delta, dk, dv, q_offsets, kv_offsets, batch_order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), lse_stride, num_heads, head_dim, max_kv_len, qk_scale, grad_scale,
        dv_scale, window, block_size, _bucket(max_q_len), _bucket(max_kv_len),
        **meta, **launch,
    )

    def grid_dq(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    kernel, launch = _kernel_and_config("dq", meta["BLOCK_D"], q.element_size())
    wrap(kernel)[grid_dq](
        q, k, v, grad_out, lse, delta, dq_rows, q_offsets, kv_offsets, batch_order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq_rows.stride(0), dq_rows.stride(1),
        lse_stride, num_heads, head_dim, max_q_len, qk_scale, grad_scale,
        window, block_size, _bucket(max_q_len), _bucket(max_kv_len),
        **meta, **launch,
    )
    if q_broadcast:
        dq = dq_rows.view(num_batches, q.shape[0], num_heads, head_dim).sum(0).to(q.dtype)
        return dq, dk, dv
    return dq_rows, dk, dv
