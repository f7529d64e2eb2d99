"""GDPA against keys and values generated inside the forward kernel (issue #71; experimental, forward only).

The personalized FFN attends each example's rows to ``N`` keys and values of its own,
``K_b = W0_k + M G_b,k`` and ``V_b = W0_v + M G_b,v`` (``W0 [N, C]`` shared, ``M [N, S]``,
``G_b [S, C]`` per example, ``S`` a few summary tokens, ``C = H * D``). Today
``gem.models.sequence.generate_weights`` writes ``K_b`` and ``V_b`` (``[B, N, C]`` each, 537 MB a
layer at gem_base's shapes) and the attention reads them back. :func:`generated_kv_forward` builds
each key and value tile where it is used: ``W0``'s tile (the same for every example, so mostly
read from L2), ``M``'s tile and the example's ``S`` rows of ``G`` (padded to 16 for the tensor
cores), summed in float32 and rounded to the attention's dtype, as the generation kernel stores
them. The math is :func:`generated_kv_reference` (the generation, then the op's reference).

Not wired into the model, no backward, and not yet measured on a GPU: ``benchmarks/attention.py
--flagship`` times it against the generation plus the op's forward at gem_base's shapes, which
decides whether the backward (the same generation inside the dK/dV and dQ kernels, the
gradients of ``W0``, ``M`` and ``G`` summed there, as ``kernels.generated_weights`` does) is built.
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
    ACTIVATION_CODES,
    dot,
    gdpa_p,
    identity,
    load_rows,
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
    _check(q, offsets, shared_k, shared_v, mix, gen_k, gen_v, activation)
    num_batches, (num_rows, num_heads, head_dim) = offsets.numel() - 1, q.shape
    num_kv, num_summary = mix.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    post_scale = 1.0 / num_kv if post_scale is None else float(post_scale)
    out = q.new_empty(num_rows, num_heads, head_dim)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or max_len == 0 or num_kv == 0:
        return out.zero_()
    kv_offsets = torch.arange(num_batches + 1, device=q.device, dtype=offsets.dtype) * num_kv
    order = batch_order(offsets, kv_offsets, wrap=wrap)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # the generation's too: W0 and M are float32
    grid = (triton.cdiv(max_len, block_m) * num_batches * num_heads,)
    wrap(_generated_kv_fwd_kernel)[grid](
        q,
        out,
        shared_k,
        shared_v,
        mix,
        gen_k,
        gen_v,
        offsets,
        order,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        shared_k.stride(0),
        shared_v.stride(0),
        mix.stride(0),
        gen_k.stride(0),
        gen_k.stride(1),
        gen_v.stride(0),
        gen_v.stride(1),
        num_heads,
        head_dim,
        num_kv,
        num_summary,
        max_len,
        scale,
        output_scale(activation, scale, post_scale),
        ACTIVATION=ACTIVATION_CODES[activation],
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        BLOCK_S=max(triton.next_power_of_2(num_summary), 16),
        DOT_PRECISION=precision,
        GEN_PRECISION=precision,
        PACKED_ACT=packed_act(q, activation, kernel_settings.current(), arch),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


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
