"""The Triton forward of jagged attention: the kernel, its inner loops, its launcher.

Reads top-down: the inner loops (masked / unmasked key tiles; GDPA's LATE_PV loop), the kernel,
then :func:`forward`, which allocates the outputs, picks the launch config and launches. Which
forward runs (this one or the Gluon one) is ``call.py``'s choice; the math is ``reference.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.jagged_attention import autotune
from kernels.jagged_attention.triton_common import (
    ACT_UNIT,
    BOUNDS,
    LOG2E,
    UNMASKED,
    UPCAST_DOTS,
    VISIBLE,
    bucket,
    dot,
    example_rows,
    gdpa_p,
    identity,
    key_interval,
    load_rows,
    load_tile,
    program_block,
    split_blocks,
    visible_mask,
)

if TYPE_CHECKING:
    from kernels.jagged_attention.call import AttentionCall

# ---------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    q,
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
        if ACTIVATION == 0:  # online softmax, log2 domain
            s = x * qk_scale
            if MASK == BOUNDS:
                s = tl.where((cols < kv_len)[None, :], s, float("-inf"))
            elif MASK == VISIBLE:
                vis = visible_mask(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = gdpa_p(x, qk_scale, v.dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION)
            if MASK == VISIBLE:
                vis = visible_mask(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p = tl.where(vis, p, 0.0)
        acc = dot(p.to(v.dtype), v, acc, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _opaque_copy(x):
    """x, through an instruction the compiler cannot see through (16- or 32-bit elements, packed
    into 32-bit registers)."""
    PACK: tl.constexpr = 32 // x.dtype.primitive_bitwidth
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=True, pack=PACK)


@triton.jit
def _fwd_gdpa_late_pv(
    acc,
    q,
    K,
    V,
    stride_kt,
    stride_vt,
    offs_d,
    dmask,
    kv_len,
    qk_scale,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
):
    """The GDPA forward's loop over all keys (no mask but the sequence end, pointer loads) with
    each tile's ``P V`` issued one step late, after the next tile's ``Q K^T``, so the tensor cores
    run it while the warps compute that tile's activation.

    Triton waits on a product where its result is first used, and only accumulating products
    (``P V``) run asynchronously past the next one; in the plain loop the activation therefore
    never overlaps a product of its own program. The price is one extra step: the first ``P V``
    multiplies zeros, the last ``Q K^T`` reads zero keys. The autotuner chooses between this loop
    and the plain one (``LATE_PV``): on an H200 it is faster for long sequences and slower for
    short ones (docs/log/kernels.md)."""
    offs_n = tl.arange(0, BLOCK_N)
    p = tl.zeros([acc.shape[0], BLOCK_N], dtype=V.dtype.element_ty)
    for n0 in range(0, kv_len + BLOCK_N, BLOCK_N):
        cols = n0 + offs_n
        k = load_tile(K, stride_kt, n0, cols, kv_len, offs_d, dmask, True, EVEN_D)
        prev = cols - BLOCK_N  # the rows of the tile whose P V runs now
        v_mask = ((prev >= 0) & (prev < kv_len))[:, None]
        if not EVEN_D:
            v_mask = v_mask & dmask[None, :]
        v = tl.load(V + prev[:, None] * stride_vt + offs_d[None, :], mask=v_mask, other=0.0)
        x = dot(q, tl.trans(k), None, DOT_PRECISION)
        if not UPCAST_DOTS:
            # An opaque copy inside the loop: Triton would stage the loop-carried operand
            # through shared memory and then wait on the product at once.
            p = _opaque_copy(p)
        acc = dot(p, v, acc, DOT_PRECISION)
        p = gdpa_p(x, qk_scale, v.dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    q_offsets,
    kv_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lse_h,
    num_heads,
    head_dim,
    max_q_len,
    qk_scale,
    out_scale,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LATE_PV: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars: keep the math (and acc) in float32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    out_scale = tl.cast(out_scale, tl.float32)
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
    Q += q_start * stride_qt + h * stride_qh
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    q = load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
        lo_any, lo_all, hi_all, hi_any = key_interval(
            m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        first, full_start, full_end, last = split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
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
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
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
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
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
    elif LATE_PV and ACTIVATION != 0:
        acc = _fwd_gdpa_late_pv(
            acc,
            q,
            K,
            V,
            stride_kt,
            stride_vt,
            offs_d,
            dmask,
            kv_len,
            qk_scale,
            ACTIVATION,
            BLOCK_N,
            EVEN_D,
            DOT_PRECISION,
            PACKED_ACT,
        )
    else:
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
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

    row_mask = rows < q_len
    if ACTIVATION == 0:
        seen = l_i > 0.0
        acc = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        tl.store(LSE + h * stride_lse_h + o_start + rows, lse, mask=row_mask)
    else:
        acc = acc * out_scale
    O += o_start * stride_ot + h * stride_oh
    o_ptrs = O + rows[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    batch_order: torch.Tensor,
    call: AttentionCall,
    meta: dict,
    wrap=identity,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel.

    Args:
        q: ``[Tq, H, D]`` (or ``[N, H, D]`` when ``q_broadcast``), last dim contiguous.
        k, v: ``[Tkv, H, D]``, last dim contiguous.
        q_offsets: ``[B+1]`` output row offsets (``arange(B+1) * N`` when ``q_broadcast``).
        kv_offsets: ``[B+1]``.
        batch_order: ``[B]`` int32, examples in the order programs take them (longest first).
        call: the call (``call.AttentionCall``): lengths, activation, scales, mask, settings.
        meta: ``triton_common.launch_meta``'s constexprs.
        wrap: ``torch.library.wrap_triton`` inside a triton_op, identity otherwise.

    Returns:
        out ``[To, H, D]`` in ``q.dtype`` and, for softmax, lse ``[H, To]`` float32 in log2
        units (``+inf`` for a query that sees no key); a 1-element placeholder otherwise.
    """
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = num_batches * q.shape[0] if call.q_broadcast else q.shape[0]
    max_q_len, max_kv_len, scale = call.max_q_len, call.max_kv_len, call.scale
    out = q.new_empty(num_rows, num_heads, head_dim)
    softmax = call.activation == "softmax"
    lse = q.new_empty((num_heads, num_rows) if softmax else (1,), dtype=torch.float32)
    if num_rows == 0 or num_heads == 0 or max_q_len == 0 or num_batches == 0:
        return out.zero_(), lse.fill_(float("inf"))
    kernel, launch = autotune.kernel_and_config(_fwd_kernel, "fwd", meta["BLOCK_D"], 2, call.settings)

    def grid(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        q,
        k,
        v,
        out,
        lse,
        q_offsets,
        kv_offsets,
        batch_order,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        num_rows,
        num_heads,
        head_dim,
        max_q_len,
        scale * LOG2E if softmax else scale,
        output_scale(call.activation, scale, call.post_scale),
        call.window,
        call.block_size,
        bucket(max_q_len),
        bucket(max_kv_len),
        **meta,
        **launch,
    )
    return out, lse


def output_scale(activation: str, scale: float, post_scale: float) -> float:
    """The GDPA forward's output factor: ``post_scale * ACT_UNIT * scale`` (1 for softmax)."""
    return 1.0 if activation == "softmax" else post_scale * ACT_UNIT[activation] * scale
