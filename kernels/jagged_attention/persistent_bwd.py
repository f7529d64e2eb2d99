"""A persistent softmax dK/dV for short jagged self-attention (issue #71; experimental, off).

The dK/dV kernel of the op (``triton_bwd._bwd_dkdv_kernel``) gives each (example, head, key
block) a program that streams the example's query tiles: at the flagship's lengths about three,
too few for the pipeliner to hide the loads of K, V and the first tiles, and it runs at 3.3x its
memory floor (``benchmarks/kernel_floors.py``). Here, as in ``persistent_fwd.py`` with the roles
swapped, a fixed number of programs walk one flat list of (item, query tile) entries, the items
being (example, key block, head), longest first, in runs of about equal cost
(``persistent_fwd.persistent_schedule`` with the block sizes exchanged). K and V are read at
every entry (from L2 after an item's first), dK and dV restart at an item's first query tile and
are stored at its last, and dS is stored at every entry for the op's dQ-from-dS kernel.

Softmax, no mask, the same rows for queries and keys. The math and the dS layout are the op's
(``[H, rows, call.store_ds_row(max_len)]``, keys by queries of their example). Not wired into the
op, not yet run on a GPU: ``benchmarks/attention.py --persistent`` times it against the op's
backward at the flagship's lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.call import store_ds_row
from kernels.jagged_attention.persistent_fwd import persistent_schedule
from kernels.jagged_attention.triton_common import LOG2E, dot, identity, load_tile


@triton.jit
def _persistent_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DS,
    offsets,
    tile_item,
    tile_index,
    run_start,
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
    num_heads,
    head_dim,
    n_blocks,
    qk_scale,
    dk_scale,
    STORE_DS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dk_scale = tl.cast(dk_scale, tl.float32)
    run = tl.program_id(0)
    first_tile = tl.load(run_start + run)
    end_tile = tl.load(run_start + run + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for t in range(first_tile, end_tile):
        item = tl.load(tile_item + t)
        m_tile = tl.load(tile_index + t)
        h = item % num_heads
        n_block = (item // num_heads) % n_blocks
        b = item // (num_heads * n_blocks)
        start = tl.load(offsets + b).to(tl.int64)
        length = (tl.load(offsets + b + 1) - start).to(tl.int32)
        cols = n_block * BLOCK_N + offs_n
        rows = m_tile * BLOCK_M + offs_m
        k = load_tile(K + start * stride_kt + h * stride_kh, stride_kt, 0, cols, length, offs_d, dmask, True, EVEN_D)
        v = load_tile(V + start * stride_vt + h * stride_vh, stride_vt, 0, cols, length, offs_d, dmask, True, EVEN_D)
        q = load_tile(Q + start * stride_qt + h * stride_qh, stride_qt, 0, rows, length, offs_d, dmask, True, EVEN_D)
        do = load_tile(
            DO + start * stride_dot + h * stride_doh, stride_dot, 0, rows, length, offs_d, dmask, True, EVEN_D
        )
        # queries past the end: lse = inf, so p = 0 and dS = 0 there
        lse = tl.load(LSE + h * stride_lse_h + start + rows, mask=rows < length, other=float("inf"))
        delta = tl.load(DELTA + h * stride_lse_h + start + rows, mask=rows < length, other=0.0)
        dk = tl.where(m_tile == 0, 0.0, dk)
        dv = tl.where(m_tile == 0, 0.0, dv)
        s_t = dot(k, tl.trans(q), None, DOT_PRECISION) * qk_scale  # [N, M]
        dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)
        p_t = tl.math.exp2(s_t - lse[None, :])
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        if STORE_DS:  # keys past the end are not stored; queries past it hold zeros (a row's
            # elements past its last tile are not written: the dQ-from-dS kernel never uses them)
            ds_ptrs = DS + h.to(tl.int64) * stride_dsh + (start + cols)[:, None] * stride_dst + rows[None, :]
            tl.store(ds_ptrs, ds_t, mask=(cols < length)[:, None])
        dv = dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dk = dot(ds_t, q, dk, DOT_PRECISION)
        if (m_tile + 1) * BLOCK_M >= length:  # the item's last query tile: its keys are done
            col_mask = (cols < length)[:, None] & dmask[None, :]
            dk_ptrs = DK + (start + cols)[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :]
            dv_ptrs = DV + (start + cols)[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :]
            tl.store(dk_ptrs, (dk * dk_scale).to(DK.dtype.element_ty), mask=col_mask)
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_mask)


def persistent_softmax_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    scale: float | None = None,
    *,
    store_ds: bool = False,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    num_runs: int | None = None,
    schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap=identity,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dK, dV (``[T, H, D]`` as ``k``) and, where ``store_ds``, dS (``[H, T, store_ds_row(max_len)]``,
    as the op's dQ-from-dS kernel reads it) of softmax self-attention of jagged rows, no mask.

    Args:
        q, k, v, grad_out: ``[T, H, D]``, the same rows (``offsets [B+1]``, lengths at most
            ``max_len``), last dimension contiguous.
        lse: ``[H, T]`` float32, log2 units, as the forward returns it; delta: ``[H, T]`` float32,
            the row sums of ``dO * O`` (``triton_bwd.preprocess``), with ``lse``'s strides.
        scale: of the scores (default ``1 / sqrt(D)``).
        block_m: query tile (a divisor of 128, as the dS rows are padded to 128); block_n: key block.
        num_warps, num_stages, num_runs, schedule, wrap: as ``persistent_softmax_forward``'s; the
            schedule is ``persistent_schedule(offsets, max_len, H, block_n, block_m, num_runs)``.
    """
    if q.dim() != 3 or any(t.shape != q.shape for t in (k, v, grad_out)):
        raise ValueError("q, k, v, grad_out must be [T, H, D] alike")
    for name, t in (("q", q), ("k", k), ("v", v), ("grad_out", grad_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    if 128 % block_m:
        raise ValueError(f"block_m must divide 128 (the dS rows' padding), got {block_m}")
    if delta.stride() != lse.stride():
        raise ValueError("delta must have lse's strides")
    num_rows, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    ds = q.new_empty((num_heads, num_rows, store_ds_row(max_len))) if store_ds else None
    if num_rows == 0 or num_heads == 0 or max_len == 0 or offsets.numel() < 2:
        return dk.zero_(), dv.zero_(), ds
    if num_runs is None:
        num_runs = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    if schedule is None:
        schedule = persistent_schedule(offsets, max_len, num_heads, block_n, block_m, num_runs)
    tile_item, tile_index, run_start = schedule
    if run_start.numel() != num_runs + 1:
        raise ValueError(f"schedule has {run_start.numel() - 1} runs, num_runs is {num_runs}")
    block_d = max(triton.next_power_of_2(head_dim), 16)
    ds_arg = q if ds is None else ds  # unread without STORE_DS
    wrap(_persistent_dkdv_kernel)[(num_runs,)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv,
        ds_arg,
        offsets,
        tile_item,
        tile_index,
        run_start,
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
        dv.stride(0),
        dv.stride(1),
        lse.stride(0),
        ds_arg.stride(0),
        ds_arg.stride(1),
        num_heads,
        head_dim,
        triton.cdiv(max_len, block_n),
        scale * LOG2E,
        scale,
        STORE_DS=store_ds,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return dk, dv, ds
