"""A persistent softmax dK/dV for short jagged attention (issue #71; experimental, off).

The dK/dV kernel of the op (``triton_bwd._bwd_dkdv_kernel``) gives each (example, head, key
block) a program that streams the example's query tiles: at the flagship's lengths about three,
too few for the pipeliner to hide the loads of K, V and the first tiles, and it runs at 3.3x its
memory floor (``benchmarks/kernel_floors.py``). Here, as in ``persistent_fwd.py`` with the roles
swapped, a fixed number of programs walk one flat list of (item, query tile) entries, the items
being (example, key block, head), longest first, in runs of about equal cost
(``persistent_fwd.persistent_schedule`` with query and key sides exchanged). K and V are read at
every entry (from L2 after an item's first), dK and dV restart at an item's first query tile and
are stored at its last, and dS is stored at every entry for the op's dQ-from-dS kernel.

Softmax, no mask, jagged queries and keys. The math, the dS layout (``[H, Tk,
call.store_ds_row(max_q_len)]``, keys by queries of their example) and the gradients' stores
(rotary, packed) are the op's (``triton_bwd.dkdv``). The op runs it with ``settings.persistent``
(off: not yet run on a GPU).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.call import store_ds_row
from kernels.jagged_attention.persistent_fwd import resolve_schedule, work_item
from kernels.jagged_attention.triton_common import LOG2E, dot, example_rows, identity, load_tile, store_grad


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
    COS,
    SIN,
    q_offsets,
    kv_offsets,
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
    stride_cs,
    dk_offset,
    dv_offset,
    num_heads,
    head_dim,
    n_blocks,
    qk_scale,
    dk_scale,
    STORE_DS: tl.constexpr,
    ROPE: tl.constexpr,
    DV_IN_DK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK and dV (and dS where STORE_DS) of the items of one run; DK, DV, ROPE and DV_IN_DK as
    ``triton_bwd._bwd_dkdv_kernel``'s."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dk_scale = tl.cast(dk_scale, tl.float32)
    run = tl.program_id(0)
    first_tile = tl.load(run_start + run)
    end_tile = tl.load(run_start + run + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    if DV_IN_DK:  # one packed gradient: a kernel may write one argument only, under torch.compile
        DV = DK + dv_offset
    else:
        DV += dv_offset
    DK += dk_offset

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for t in range(first_tile, end_tile):
        m_tile = tl.load(tile_index + t)
        b, n_block, h = work_item(tl.load(tile_item + t), num_heads, n_blocks)
        q_start, q_len, kv_start, kv_len = example_rows(
            tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1)
        )
        cols = n_block * BLOCK_N + offs_n
        rows = m_tile * BLOCK_M + offs_m
        k = load_tile(K + kv_start * stride_kt + h * stride_kh, stride_kt, 0, cols, kv_len, offs_d, dmask, True, EVEN_D)
        v = load_tile(V + kv_start * stride_vt + h * stride_vh, stride_vt, 0, cols, kv_len, offs_d, dmask, True, EVEN_D)
        q = load_tile(Q + q_start * stride_qt + h * stride_qh, stride_qt, 0, rows, q_len, offs_d, dmask, True, EVEN_D)
        do = load_tile(
            DO + q_start * stride_dot + h * stride_doh, stride_dot, 0, rows, q_len, offs_d, dmask, True, EVEN_D
        )
        # queries past the end (or an example without queries): lse = inf, so p = 0 and dS = 0
        lse = tl.load(LSE + h * stride_lse_h + q_start + rows, mask=rows < q_len, other=float("inf"))
        delta = tl.load(DELTA + h * stride_lse_h + q_start + rows, mask=rows < q_len, other=0.0)
        dk = tl.where(m_tile == 0, 0.0, dk)
        dv = tl.where(m_tile == 0, 0.0, dv)
        s_t = dot(k, tl.trans(q), None, DOT_PRECISION) * qk_scale  # [N, M]
        dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)
        p_t = tl.math.exp2(s_t - lse[None, :])
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        if STORE_DS:  # keys past the end are not stored; queries past it hold zeros (a row's
            # elements past its last tile are not written: the dQ-from-dS kernel never uses them)
            ds_ptrs = DS + h.to(tl.int64) * stride_dsh + (kv_start + cols)[:, None] * stride_dst + rows[None, :]
            tl.store(ds_ptrs, ds_t, mask=(cols < kv_len)[:, None])
        dv = dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dk = dot(ds_t, q, dk, DOT_PRECISION)
        if (m_tile + 1) * BLOCK_M >= q_len:  # the item's last query tile: its keys are done
            col_mask = cols < kv_len
            table_rows = kv_start + cols
            dk_rows = DK + kv_start * stride_dkt + h * stride_dkh
            dv_rows = DV + kv_start * stride_dvt + h * stride_dvh
            store_grad(
                dk_rows, cols, stride_dkt, offs_d, col_mask, dmask, dk * dk_scale, COS, SIN, table_rows, stride_cs,
                ROPE, BLOCK_D,
            )  # fmt: skip
            store_grad(
                dv_rows, cols, stride_dvt, offs_d, col_mask, dmask, dv, COS, SIN, table_rows, stride_cs, False, BLOCK_D
            )


def persistent_softmax_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    scale: float | None = None,
    *,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    offsets: tuple[int, int] = (0, 0),
    ds: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    num_runs: int | None = None,
    schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap=identity,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV of softmax attention of jagged rows, no mask, and dS into ``ds`` where given.

    Args:
        q, grad_out: ``[Tq, H, D]`` (``q_offsets [B+1]``, lengths at most ``max_q_len``); k, v:
            ``[Tk, H, D]`` (``kv_offsets``, ``max_kv_len``); last dimension contiguous.
        lse: ``[H, Tq]`` float32, log2 units, as the forward returns it; delta: ``[H, Tq]`` float32,
            the row sums of ``dO * O`` (``triton_bwd.preprocess``), with ``lse``'s strides.
        scale: of the scores (default ``1 / sqrt(D)``).
        dk, dv: where the gradients go (allocated like ``k`` and ``v`` when None); ``offsets``:
            elements from their data to their first row; ``dv`` may be ``dk`` (one packed buffer,
            written through ``dk`` only), as ``triton_bwd.dkdv`` takes them.
        ds: ``[H, Tk, store_ds_row(max_q_len)]``, dS of each key by the queries of its example, as
            the op's dQ-from-dS kernel reads it; None: not stored.
        rope: ``(cos, sin)``: Q and K are the rotated operands, and dK is turned back through the
            rotation as it is stored (``triton_common.store_grad``; head dim a power of 2).
        block_m: query tile (a divisor of 128, as the dS rows are padded to 128); block_n: key block.
        num_warps, num_stages, num_runs, schedule, wrap: as ``persistent_softmax_forward``'s; the
            schedule is ``persistent_schedule(kv_offsets, q_offsets, max_kv_len, max_q_len, H,
            block_n, block_m, num_runs)``.

    Returns:
        ``(dk, dv)``.
    """
    if q.dim() != 3 or grad_out.shape != q.shape or k.shape != v.shape or k.shape[1:] != q.shape[1:]:
        raise ValueError("q and grad_out must be [Tq, H, D] alike, k and v [Tk, H, D] alike")
    for name, t in (("q", q), ("k", k), ("v", v), ("grad_out", grad_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    if 128 % block_m:
        raise ValueError(f"block_m must divide 128 (the dS rows' padding), got {block_m}")
    if delta.stride() != lse.stride():
        raise ValueError("delta must have lse's strides")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if ds is not None and ds.shape != (num_heads, k.shape[0], store_ds_row(max_q_len)):
        raise ValueError(f"ds must be [H, Tk, store_ds_row(max_q_len)], got {tuple(ds.shape)}")
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if rope is not None and block_d != head_dim:
        raise ValueError(f"rope: dK is turned back for a power-of-two head dim, not {head_dim}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if k.shape[0] == 0 or num_heads == 0 or max_kv_len == 0 or kv_offsets.numel() < 2:
        return dk, dv
    num_runs, (tile_item, tile_index, run_start) = resolve_schedule(
        schedule, num_runs, q, kv_offsets, q_offsets, max_kv_len, max_q_len, block_n, block_m
    )
    cos, sin = rope if rope is not None else (q, q)  # (unread stand-ins without ROPE)
    ds_arg = q if ds is None else ds  # unread without STORE_DS
    packed = dv is dk
    wrap(_persistent_dkdv_kernel)[(num_runs,)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        q if packed else dv,
        ds_arg,
        cos,
        sin,
        q_offsets,
        kv_offsets,
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
        cos.stride(0) if rope is not None else 0,
        *offsets,
        num_heads,
        head_dim,
        triton.cdiv(max_kv_len, block_n),
        scale * LOG2E,
        scale,
        STORE_DS=ds is not None,
        ROPE=rope is not None,
        DV_IN_DK=packed,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return dk, dv
