"""GDPA against keys and values generated inside the kernels (issue #71; experimental, not wired in).

The personalized FFN attends each example's rows to ``N`` keys and values of its own,
``K_b = W0_k + M G_b,k`` and ``V_b = W0_v + M G_b,v`` (``W0 [N, C]`` shared, ``M [N, S]``,
``G_b [S, C]`` per example, ``S`` a few summary tokens, ``C = H * D``). Today
``gem.models.sequence.generate_weights`` writes ``K_b`` and ``V_b`` (``[B, N, C]`` each, 537 MB a
layer at gem_base's shapes), the attention reads them back, and its backward writes their
gradients as large again, which the generation's backward then sums. Here every kernel builds
each key and value tile where it is used: ``W0``'s tile (the same for every example, so mostly
read from L2), ``M``'s tile and the example's ``S`` rows of ``G`` (padded to 16 for the tensor
cores), summed in float32 and rounded to the attention's dtype, as the generation kernel stores
them.

* :func:`generated_kv_forward`: one program per (row block, example, head), as the op's forward.
* :func:`generated_kv_backward`: a dK/dV kernel whose programs each own one key tile of one head
  for a group of examples and keep what the examples' dK_b and dV_b contribute (``W0``'s, ``M``'s
  and ``G_b``'s gradients) instead of writing them; then dQ over the forward's programs.
* :func:`generated_kv_attention`: both, through autograd.

The math is :func:`generated_kv_reference` (the generation, then the op's reference). Not yet
measured on a GPU: ``benchmarks/attention.py --generated-kv`` times forward and backward against
the model's path at gem_base's shapes, which decides whether the model takes it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.jagged_attention import settings as kernel_settings
from kernels.jagged_attention.batch_order import batch_order
from kernels.jagged_attention.reference import ACTIVATIONS, jagged_attention_reference
from kernels.jagged_attention.triton_common import (
    ACT_UNIT,
    ACTIVATION_CODES,
    dot,
    gdpa_act_and_grad,
    gdpa_act_and_grad_packed,
    gdpa_p,
    identity,
    load_rows,
    load_tile,
    packed_act,
    program_block,
)
from kernels.jagged_attention.triton_fwd import output_scale

POINTWISE = tuple(a for a in ACTIVATIONS if a != "softmax")


@triton.jit
def _generated_tile(W0, stride_w0, mix, g, cols, num_kv, offs_d, dmask, GEN_PRECISION: tl.constexpr):
    """Rows ``cols`` of ``W0 + M G`` for one head, float32, zero beyond ``num_kv``: ``W0`` points at
    the head's first column, ``mix`` holds the rows' ``[BLOCK_N, BLOCK_S]`` of ``M`` and ``g`` the
    head's ``[BLOCK_S, BLOCK_D]`` of ``G`` (float32 both)."""
    w0 = tl.load(
        W0 + cols[:, None] * stride_w0 + offs_d[None, :], mask=(cols < num_kv)[:, None] & dmask[None, :], other=0.0
    )
    return dot(mix, g, w0.to(tl.float32), GEN_PRECISION)


@triton.jit(do_not_specialize=["max_q_len"])
def _generated_kv_fwd_kernel(
    Q,
    O,
    W0K,
    W0V,
    MIX,
    GK,
    GV,
    q_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_w0k,
    stride_w0v,
    stride_mix,
    stride_gkb,
    stride_gks,
    stride_gvb,
    stride_gvs,
    num_heads,
    head_dim,
    num_kv,
    num_summary,
    max_q_len,
    qk_scale,
    out_scale,
    ACTIVATION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEN_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars: keep the math (and acc) in float32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    out_scale = tl.cast(out_scale, tl.float32)
    m_block, rank, h = program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank).to(tl.int64)
    q_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_summary
    Q += q_start * stride_qt + h * stride_qh
    q = load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    column = h * head_dim  # the head's first column of W0 and G
    g_mask = smask[:, None] & dmask[None, :]
    g_offs = offs_s[:, None] * stride_gks + column + offs_d[None, :]
    gk = tl.load(GK + b * stride_gkb + g_offs, mask=g_mask, other=0.0).to(tl.float32)
    g_offs = offs_s[:, None] * stride_gvs + column + offs_d[None, :]
    gv = tl.load(GV + b * stride_gvb + g_offs, mask=g_mask, other=0.0).to(tl.float32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, num_kv, BLOCK_N):
        cols = n0 + offs_n
        # Keys past num_kv are zero, so their scores are 0 and every pointwise activation of 0 is 0.
        mix_mask = (cols < num_kv)[:, None] & smask[None, :]
        mix = tl.load(MIX + cols[:, None] * stride_mix + offs_s[None, :], mask=mix_mask, other=0.0).to(tl.float32)
        k = _generated_tile(W0K + column, stride_w0k, mix, gk, cols, num_kv, offs_d, dmask, GEN_PRECISION)
        v = _generated_tile(W0V + column, stride_w0v, mix, gv, cols, num_kv, offs_d, dmask, GEN_PRECISION)
        k, v = k.to(Q.dtype.element_ty), v.to(Q.dtype.element_ty)
        x = dot(q, tl.trans(k), None, DOT_PRECISION)
        p = gdpa_p(x, qk_scale, v.dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION)
        acc = dot(p, v, acc, DOT_PRECISION)

    acc = acc * out_scale
    O += q_start * stride_ot + h * stride_oh
    tl.store(
        O + rows[:, None] * stride_ot + offs_d[None, :],
        acc.to(O.dtype.element_ty),
        mask=(rows < q_len)[:, None] & dmask[None, :],
    )


@triton.jit
def _load_mix(MIX, stride_mix, cols, num_kv, offs_s, smask):
    """Rows ``cols`` of ``M [N, S]`` as ``[BLOCK_N, BLOCK_S]`` float32, zero past N and S."""
    mask = (cols < num_kv)[:, None] & smask[None, :]
    return tl.load(MIX + cols[:, None] * stride_mix + offs_s[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_generated(G, stride_s, column, offs_s, smask, offs_d, dmask):
    """One head's ``[BLOCK_S, BLOCK_D]`` of an example's ``G [S, H * D]`` (G at the example) in
    float32, zero past S and D; ``column``: the head's first column."""
    ptrs = G + offs_s[:, None] * stride_s + column + offs_d[None, :]
    return tl.load(ptrs, mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scores_grad(
    x, dp, scale, dtype: tl.constexpr, ACTIVATION: tl.constexpr, PACKED_ACT: tl.constexpr, FAST: tl.constexpr
):
    """(P, dS) in ``dtype`` of the raw scores x and dP (float32, any layout), without the factors
    ``unit * scale`` and ``post_scale`` that the launcher folds into ``grad_scale``: the Triton
    dK/dV kernel's GDPA step (``triton_common.gdpa_act_and_grad``)."""
    if PACKED_ACT:
        return gdpa_act_and_grad_packed(x.to(dtype), dp.to(dtype), scale, ACTIVATION)
    p, g = gdpa_act_and_grad(x, scale, ACTIVATION, FAST)
    return p.to(dtype), (dp * g).to(dtype)


@triton.jit(do_not_specialize=["num_batches"])
def _generated_kv_dkdv_kernel(
    Q,
    DO,
    W0K,
    W0V,
    MIX,
    GK,
    GV,
    DW0K,
    DW0V,
    DMIX,
    DGK,
    DGV,
    q_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    stride_w0k,
    stride_w0v,
    stride_mix,
    stride_gkb,
    stride_gks,
    stride_gvb,
    stride_gvs,
    num_batches,
    num_heads,
    head_dim,
    num_kv,
    num_summary,
    qk_scale,
    grad_scale,
    ACTIVATION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEN_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key tile j (grid axis 0) of head h (axis 1) over the examples of group g (axis 2: ranks g,
    g + G, ... of ``batch_order``). Per example it builds the tile's K and V, runs over the
    example's query rows (dK_b, dV_b) and takes from them: the sums over its examples of dK_b and
    dV_b (``W0``'s gradient, added into this program's tiles of ``DW0K/DW0V [G, N, C]``) and of
    ``dK_b G_b,k^T + dV_b G_b,v^T`` (``M``'s, in registers, then ``DMIX [G, H, N, BLOCK_S]``), and
    ``M^T dK_b``, ``M^T dV_b`` (``G_b``'s, this tile's share, ``DGK/DGV [tiles, B, S, C]``); all
    float32, which the launcher adds up: no per-example dK/dV in memory."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # (fp64 under Inductor)
    grad_scale = tl.cast(grad_scale, tl.float32)
    j = tl.program_id(0)
    h = tl.program_id(1)
    group = tl.program_id(2)
    num_groups = tl.num_programs(2)
    dtype = Q.dtype.element_ty
    fast = DOT_PRECISION != "ieee"

    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_summary
    offs_m = tl.arange(0, BLOCK_M)
    column = h * head_dim  # the head's first column of W0 and G
    width = num_heads * head_dim
    dmix = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    for rank in range(group, num_batches, num_groups):
        b = tl.load(batch_order + rank).to(tl.int64)
        q_start = tl.load(q_offsets + b).to(tl.int64)
        q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
        # this example's keys and values, rounded as the forward's (zero past num_kv)
        mix = _load_mix(MIX, stride_mix, cols, num_kv, offs_s, smask)
        gk = _load_generated(GK + b * stride_gkb, stride_gks, column, offs_s, smask, offs_d, dmask)
        gv = _load_generated(GV + b * stride_gvb, stride_gvs, column, offs_s, smask, offs_d, dmask)
        k = _generated_tile(W0K + column, stride_w0k, mix, gk, cols, num_kv, offs_d, dmask, GEN_PRECISION).to(dtype)
        v = _generated_tile(W0V + column, stride_w0v, mix, gv, cols, num_kv, offs_d, dmask, GEN_PRECISION).to(dtype)
        q_ptr = Q + q_start * stride_qt + h * stride_qh
        do_ptr = DO + q_start * stride_dot + h * stride_doh
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for m0 in range(0, q_len, BLOCK_M):
            rows = m0 + offs_m
            q = load_tile(q_ptr, stride_qt, m0, rows, q_len, offs_d, dmask, True, EVEN_D)
            do = load_tile(do_ptr, stride_dot, m0, rows, q_len, offs_d, dmask, True, EVEN_D)
            x_t = dot(k, tl.trans(q), None, DOT_PRECISION)  # [N, M] raw scores
            dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)
            p_t, ds_t = _scores_grad(x_t, dp_t, qk_scale, dtype, ACTIVATION, PACKED_ACT, fast)
            dv = dot(p_t, do, dv, DOT_PRECISION)
            dk = dot(ds_t, q, dk, DOT_PRECISION)
        dk = dk * grad_scale
        dv = dv * grad_scale
        # W0's sums go through memory (L2): in registers they would spill. Each of this program's
        # tiles of the partials (zeroed by the launcher) is its own; the barrier orders one
        # example's stores before the next one's loads.
        tl.debug_barrier()
        partial = (group * num_kv + cols[:, None]).to(tl.int64) * width + column + offs_d[None, :]
        tile_mask = (cols < num_kv)[:, None] & dmask[None, :]
        share = (j * num_batches + b) * num_summary * width + offs_s[:, None] * width + column + offs_d[None, :]
        g_mask = smask[:, None] & dmask[None, :]
        tl.store(DW0K + partial, tl.load(DW0K + partial, mask=tile_mask) + dk, mask=tile_mask)
        dmix = dot(dk, tl.trans(gk), dmix, GEN_PRECISION)
        tl.store(DGK + share, dot(tl.trans(mix), dk, None, GEN_PRECISION), mask=g_mask)
        tl.store(DW0V + partial, tl.load(DW0V + partial, mask=tile_mask) + dv, mask=tile_mask)
        dmix = dot(dv, tl.trans(gv), dmix, GEN_PRECISION)
        tl.store(DGV + share, dot(tl.trans(mix), dv, None, GEN_PRECISION), mask=g_mask)

    mix_partial = ((group * num_heads + h) * num_kv + cols[:, None]).to(tl.int64) * BLOCK_S + offs_s[None, :]
    tl.store(DMIX + mix_partial, dmix, mask=(cols < num_kv)[:, None])


@triton.jit(do_not_specialize=["max_q_len"])
def _generated_kv_dq_kernel(
    Q,
    DO,
    DQ,
    W0K,
    W0V,
    MIX,
    GK,
    GV,
    q_offsets,
    batch_order,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_w0k,
    stride_w0v,
    stride_mix,
    stride_gkb,
    stride_gks,
    stride_gvb,
    stride_gvs,
    num_heads,
    head_dim,
    num_kv,
    num_summary,
    max_q_len,
    qk_scale,
    grad_scale,
    ACTIVATION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GEN_PRECISION: tl.constexpr,
    PACKED_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of one (row block, example, head), the forward's programs: ``dS K_b`` over the generated
    key tiles, dS recomputed from the scores and ``dP = dO V_b^T``."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    grad_scale = tl.cast(grad_scale, tl.float32)
    m_block, rank, h = program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank).to(tl.int64)
    q_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return

    dtype = Q.dtype.element_ty
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_summary
    q = load_tile(Q + q_start * stride_qt + h * stride_qh, stride_qt, m0, rows, q_len, offs_d, dmask, True, EVEN_D)
    do = load_tile(DO + q_start * stride_dot + h * stride_doh, stride_dot, m0, rows, q_len, offs_d, dmask, True, EVEN_D)
    column = h * head_dim
    g_mask = smask[:, None] & dmask[None, :]
    gk = tl.load(GK + b * stride_gkb + offs_s[:, None] * stride_gks + column + offs_d[None, :], mask=g_mask, other=0.0)
    gv = tl.load(GV + b * stride_gvb + offs_s[:, None] * stride_gvs + column + offs_d[None, :], mask=g_mask, other=0.0)
    gk, gv = gk.to(tl.float32), gv.to(tl.float32)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, num_kv, BLOCK_N):
        cols = n0 + offs_n
        mix_mask = (cols < num_kv)[:, None] & smask[None, :]
        mix = tl.load(MIX + cols[:, None] * stride_mix + offs_s[None, :], mask=mix_mask, other=0.0).to(tl.float32)
        k = _generated_tile(W0K + column, stride_w0k, mix, gk, cols, num_kv, offs_d, dmask, GEN_PRECISION).to(dtype)
        v = _generated_tile(W0V + column, stride_w0v, mix, gv, cols, num_kv, offs_d, dmask, GEN_PRECISION).to(dtype)
        x = dot(q, tl.trans(k), None, DOT_PRECISION)
        dp = dot(do, tl.trans(v), None, DOT_PRECISION)
        _, ds = _scores_grad(x, dp, qk_scale, dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION != "ieee")
        dq = dot(ds, k, dq, DOT_PRECISION)

    dq = dq * grad_scale
    tl.store(
        DQ + (q_start + rows[:, None]) * stride_dqt + h * stride_dqh + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=(rows < q_len)[:, None] & dmask[None, :],
    )


def _check(q, offsets, shared_k, shared_v, mix, gen_k, gen_v, activation) -> None:
    if activation not in POINTWISE:
        raise ValueError(f"activation={activation!r}: generated K/V take a pointwise activation, one of {POINTWISE}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    width = q.shape[1] * q.shape[2]
    num_kv, num_summary = mix.shape
    for name, t in (("shared_k", shared_k), ("shared_v", shared_v)):
        if tuple(t.shape) != (num_kv, width):
            raise ValueError(f"{name} must be [N, H * D] = {(num_kv, width)}, got {tuple(t.shape)}")
    for name, t in (("gen_k", gen_k), ("gen_v", gen_v)):
        if tuple(t.shape) != (offsets.numel() - 1, num_summary, width):
            raise ValueError(
                f"{name} must be [B, S, H * D] = {(offsets.numel() - 1, num_summary, width)}, got {tuple(t.shape)}"
            )
    for name, t in (
        ("q", q),
        ("shared_k", shared_k),
        ("shared_v", shared_v),
        ("mix", mix),
        ("gen_k", gen_k),
        ("gen_v", gen_v),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")


def _setup(q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale, wrap, arch):
    """What both launchers derive from their arguments (checked first): ``(scale, post_scale,
    launch)``, the scales with their defaults (``1 / sqrt(D)``, ``1 / N``), and ``launch`` None
    where there is nothing to compute, else the examples' order, the weights' strides in the
    kernels' argument order and the constexprs every kernel takes."""
    _check(q, offsets, shared_k, shared_v, mix, gen_k, gen_v, activation)
    num_batches, (num_rows, num_heads, head_dim) = offsets.numel() - 1, q.shape
    num_kv, num_summary = mix.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    post_scale = 1.0 / num_kv if post_scale is None else float(post_scale)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or max_len == 0 or num_kv == 0:
        return scale, post_scale, None
    kv_offsets = torch.arange(num_batches + 1, device=q.device, dtype=offsets.dtype) * num_kv
    block_d = max(triton.next_power_of_2(head_dim), 16)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # the generation's too: W0 and M are float32
    launch = dict(
        order=batch_order(offsets, kv_offsets, wrap=wrap),
        strides=(
            shared_k.stride(0),
            shared_v.stride(0),
            mix.stride(0),
            gen_k.stride(0),
            gen_k.stride(1),
            gen_v.stride(0),
            gen_v.stride(1),
        ),
        constexprs=dict(
            ACTIVATION=ACTIVATION_CODES[activation],
            BLOCK_D=block_d,
            EVEN_D=block_d == head_dim,
            BLOCK_S=max(triton.next_power_of_2(num_summary), 16),
            DOT_PRECISION=precision,
            GEN_PRECISION=precision,
            PACKED_ACT=packed_act(q, activation, kernel_settings.current(), arch),
        ),
    )
    return scale, post_scale, launch


def generated_kv_forward(
    q: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    mix: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    activation: str = "silu",
    scale: float | None = None,
    post_scale: float | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    wrap=identity,
    arch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out [T, H, D]``: each example's rows ``q[offsets[b]:offsets[b+1]]`` attend (GDPA,
    ``activation``) to ``K_b = shared_k + mix @ gen_k[b]`` and ``V_b = shared_v + mix @ gen_v[b]``
    (viewed ``[N, H, D]``), as :func:`generated_kv_reference`; no gradient.

    Args:
        q: ``[T, H, D]`` queries, last dim contiguous.
        offsets: ``[B+1]`` row offsets of the examples in ``q``; ``max_len`` bounds their lengths.
        shared_k, shared_v: ``[N, H * D]`` (``W0``'s key and value halves).
        mix: ``[N, S]``.
        gen_k, gen_v: ``[B, S, H * D]``.
        scale: of the scores (default ``1 / sqrt(D)``); post_scale: of the output (default ``1 / N``).
        block_m, block_n, num_warps, num_stages: the launch config (no autotuning yet).
        wrap: ``torch.library.wrap_triton`` or a compile-only stand-in; arch: the GPU to build for
            (default ``q``'s device), which picks the bf16x2 activation path.
    """
    scale, post_scale, launch = _setup(
        q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale, wrap, arch
    )
    num_batches, (num_rows, num_heads, head_dim) = offsets.numel() - 1, q.shape
    out = q.new_empty(num_rows, num_heads, head_dim)
    if launch is None:
        return out.zero_()
    wrap(_generated_kv_fwd_kernel)[(triton.cdiv(max_len, block_m) * num_batches * num_heads,)](
        q,
        out,
        shared_k,
        shared_v,
        mix,
        gen_k,
        gen_v,
        offsets,
        launch["order"],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *launch["strides"],
        num_heads,
        head_dim,
        *mix.shape,
        max_len,
        scale,
        output_scale(activation, scale, post_scale),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch["constexprs"],
    )
    return out


def generated_kv_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    mix: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    activation: str = "silu",
    scale: float | None = None,
    post_scale: float | None = None,
    *,
    block_m: int = 32,
    block_n: int = 64,
    groups: int = 32,
    num_warps: int = 8,
    dq_block_m: int = 64,
    dq_block_n: int = 64,
    dq_num_warps: int = 4,
    num_stages: int = 2,
    wrap=identity,
    arch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The gradients of :func:`generated_kv_forward`'s output (``grad_out``, shaped as ``q``) with
    respect to ``q, shared_k, shared_v, mix, gen_k, gen_v``, each in its input's dtype; arguments
    as the forward's. Two kernels: one over (key tile, head, group of ``groups`` examples) that sums
    what its examples contribute to the weights' gradients instead of writing each example's dK and
    dV (see ``_generated_kv_dkdv_kernel``), and dQ over the forward's programs. ``block_m``,
    ``block_n``, ``num_warps``: the first's query rows a step, keys a tile and warps;
    ``dq_block_m``, ``dq_block_n``, ``dq_num_warps``: dQ's."""
    if grad_out.shape != q.shape or grad_out.stride(-1) != 1:
        raise ValueError(f"grad_out must be shaped as q {tuple(q.shape)} with its last dimension contiguous")
    scale, post_scale, launch = _setup(
        q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale, wrap, arch
    )
    num_batches, (_, num_heads, head_dim) = offsets.numel() - 1, q.shape
    num_kv, num_summary = mix.shape
    dq = torch.zeros_like(q)
    if launch is None:
        return (dq, *(torch.zeros_like(t) for t in (shared_k, shared_v, mix, gen_k, gen_v)))
    grad_scale = scale * post_scale * ACT_UNIT[activation]
    width = num_heads * head_dim
    order, strides, constexprs = launch["order"], launch["strides"], launch["constexprs"] | dict(num_stages=num_stages)
    groups = max(1, min(groups, num_batches))
    tiles = triton.cdiv(num_kv, block_n)
    part = dict(device=q.device, dtype=torch.float32)
    dw0k, dw0v = (torch.zeros(groups, num_kv, width, **part) for _ in range(2))
    dmix = torch.empty(groups, num_heads, num_kv, constexprs["BLOCK_S"], **part)
    dgk, dgv = (torch.empty(tiles, num_batches, num_summary, width, **part) for _ in range(2))
    wrap(_generated_kv_dkdv_kernel)[(tiles, num_heads, groups)](
        q,
        grad_out,
        shared_k,
        shared_v,
        mix,
        gen_k,
        gen_v,
        dw0k,
        dw0v,
        dmix,
        dgk,
        dgv,
        offsets,
        order,
        q.stride(0),
        q.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        *strides,
        num_batches,
        num_heads,
        head_dim,
        num_kv,
        num_summary,
        scale,
        grad_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **constexprs,
    )
    wrap(_generated_kv_dq_kernel)[(triton.cdiv(max_len, dq_block_m) * num_batches * num_heads,)](
        q,
        grad_out,
        dq,
        shared_k,
        shared_v,
        mix,
        gen_k,
        gen_v,
        offsets,
        order,
        q.stride(0),
        q.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        dq.stride(0),
        dq.stride(1),
        *strides,
        num_heads,
        head_dim,
        num_kv,
        num_summary,
        max_len,
        scale,
        grad_scale,
        BLOCK_M=dq_block_m,
        BLOCK_N=dq_block_n,
        num_warps=dq_num_warps,
        **constexprs,
    )
    return (
        dq,
        dw0k.sum(0).to(shared_k.dtype),
        dw0v.sum(0).to(shared_v.dtype),
        dmix.sum((0, 1))[:, :num_summary].to(mix.dtype),
        dgk.sum(0).to(gen_k.dtype),
        dgv.sum(0).to(gen_v.dtype),
    )


class _GeneratedKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale):
        ctx.save_for_backward(q, offsets, shared_k, shared_v, mix, gen_k, gen_v)
        ctx.args = (max_len, activation, scale, post_scale)
        return generated_kv_forward(
            q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale
        )

    @staticmethod
    def backward(ctx, grad_out):
        q, offsets, shared_k, shared_v, mix, gen_k, gen_v = ctx.saved_tensors
        max_len, activation, scale, post_scale = ctx.args
        grads = generated_kv_backward(
            grad_out.contiguous(),
            q,
            offsets,
            max_len,
            shared_k,
            shared_v,
            mix,
            gen_k,
            gen_v,
            activation,
            scale,
            post_scale,
        )
        dq, d_shared_k, d_shared_v, d_mix, d_gen_k, d_gen_v = grads
        return dq, None, None, d_shared_k, d_shared_v, d_mix, d_gen_k, d_gen_v, None, None, None


def generated_kv_attention(
    q: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    mix: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    activation: str = "silu",
    scale: float | None = None,
    post_scale: float | None = None,
) -> torch.Tensor:
    """:func:`generated_kv_forward`, differentiable in ``q, shared_k, shared_v, mix, gen_k, gen_v``
    (:func:`generated_kv_backward`); eager only, default launch configs."""
    return _GeneratedKV.apply(q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v, activation, scale, post_scale)


def generated_kv_reference(
    q: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    mix: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    activation: str = "silu",
    scale: float | None = None,
    post_scale: float | None = None,
) -> torch.Tensor:
    """The spec of :func:`generated_kv_forward`: the keys and values generated in float32 and
    rounded to ``q``'s dtype (as the compiled generation stores them), then the op's reference."""
    _check(q, offsets, shared_k, shared_v, mix, gen_k, gen_v, activation)
    num_batches, (_, num_heads, head_dim) = offsets.numel() - 1, q.shape
    num_kv = mix.shape[0]

    def generate(shared, gen):
        product = torch.einsum("ns,bsc->bnc", mix.float(), gen.float())
        return (shared.float() + product).to(q.dtype).reshape(num_batches * num_kv, num_heads, head_dim)

    kv_offsets = torch.arange(num_batches + 1, device=q.device, dtype=offsets.dtype) * num_kv
    return jagged_attention_reference(
        q,
        generate(shared_k, gen_k),
        generate(shared_v, gen_v),
        offsets,
        kv_offsets,
        max_len,
        num_kv,
        activation=activation,
        scale=scale,
        post_scale=1.0 / num_kv if post_scale is None else post_scale,
    )
