"""A persistent softmax forward for short jagged attention (issue #71; experimental, off).

At the flagship's lengths (mean 201 rows) a query tile of the Triton forward meets about three
key tiles: its programs spend much of their time loading Q and storing O, with no key loop long
enough for the software pipeliner to hide either, and the forward runs at 3.2x its memory floor
(``benchmarks/kernel_floors.py``). Here a fixed number of programs walk one flat list of key
tiles instead: every entry names a work item (example, query tile, head) and one of its key
tiles, the items ordered longest first and cut into contiguous, item-aligned runs of about equal
cost (:func:`persistent_schedule`, torch ops on the device, no host sync). Each program runs one
loop over its run, so the loads of the next item's first tiles are issued while the current
item's last tile computes; the running max restarts at an item's first tile, and its last tile
writes O and the log-sum-exp.

Softmax, no mask, jagged queries and keys. The math and the outputs (``out``, ``lse [H, Tq]`` in
log2 units) are the Triton forward's (``triton_fwd.forward``); the dK/dV of the same structure is
``persistent_bwd.py``. The op runs both with ``settings.persistent`` (off: not yet run on a GPU);
``benchmarks/attention.py --persistent`` times them against the op's kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.triton_common import LOG2E, dot, example_rows, identity, load_tile


@triton.jit
def work_item(item, num_heads, blocks):
    """(example, block, head) of work item ``item``, numbered ``(b * blocks + block) * num_heads + h``
    (:func:`persistent_schedule`)."""
    return item // (num_heads * blocks), (item // num_heads) % blocks, item % num_heads


@triton.jit
def _persistent_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
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
    stride_ot,
    stride_oh,
    stride_lse_h,
    num_heads,
    head_dim,
    m_blocks,
    qk_scale,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars: keep the math (and acc) in float32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    run = tl.program_id(0)
    first_tile = tl.load(run_start + run)
    end_tile = tl.load(run_start + run + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(first_tile, end_tile):
        n_tile = tl.load(tile_index + t)
        b, m_block, h = work_item(tl.load(tile_item + t), num_heads, m_blocks)
        q_start, q_len, kv_start, kv_len = example_rows(
            tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1)
        )
        rows = m_block * BLOCK_M + offs_m
        cols = n_tile * BLOCK_N + offs_n
        # Q is read at every key tile (from L2 after the first), so that its load pipelines as the
        # tiles' do. At an item's first tile the running max restarts at -inf, so the old sum and
        # accumulator are scaled by exp2(-inf) = 0.
        q = load_tile(Q + q_start * stride_qt + h * stride_qh, stride_qt, 0, rows, q_len, offs_d, dmask, True, EVEN_D)
        k = load_tile(K + kv_start * stride_kt + h * stride_kh, stride_kt, 0, cols, kv_len, offs_d, dmask, True, EVEN_D)
        v = load_tile(V + kv_start * stride_vt + h * stride_vh, stride_vt, 0, cols, kv_len, offs_d, dmask, True, EVEN_D)
        m_i = tl.where(n_tile == 0, float("-inf"), m_i)
        s = dot(q, tl.trans(k), None, DOT_PRECISION) * qk_scale
        s = tl.where((cols < kv_len)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (an example without keys)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
        if (n_tile + 1) * BLOCK_N >= kv_len:  # the item's last key tile: its rows are done
            row_mask = rows < q_len
            seen = l_i > 0.0  # a query without keys: out 0, lse +inf, as the Triton forward's
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
            tl.store(LSE + h * stride_lse_h + q_start + rows, lse, mask=row_mask)
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            o_ptrs = O + (q_start + rows)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


def persistent_schedule(
    item_offsets: torch.Tensor,
    tile_offsets: torch.Tensor,
    max_item_len: int,
    max_tile_len: int,
    num_heads: int,
    item_block: int,
    tile_block: int,
    num_runs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The work of a persistent kernel as one list of tiles, cut into runs.

    Work items are (example ``b``, block ``m`` of its ``item_offsets`` rows, head ``h``),
    numbered ``(b * M + m) * H + h`` with ``M = cdiv(max_item_len, item_block)``. An item exists
    where ``m * item_block`` is below the example's item rows, and has ``cdiv(L, tile_block)``
    tiles of its ``tile_offsets`` rows (``L`` of them), at least one (a tile of none then stands
    for an example without keys, or without queries). The forward's items are query blocks over
    key tiles; the dK/dV's, key blocks over query tiles. Items are ordered by their number of
    tiles, longest first (ties in number order), and their tiles listed in turn. Run ``r`` covers
    entries ``run_start[r]:run_start[r + 1]``: each starts at an item's first tile, at about
    ``r / num_runs`` of the list's cost (a tile counting 1, an item 1 more, for its first loads and
    its stores). Torch ops on the offsets' device, sized by the max lengths (no host sync).

    Returns:
        tile_item, tile_index: ``[B * M * H * cdiv(max_tile_len, tile_block)]`` int32, each entry's
            item and tile (entries past the list's end repeat the last item's).
        run_start: ``[num_runs + 1]`` int32, non-decreasing, from 0 to the number of tiles.
    """
    item_lengths = (item_offsets[1:] - item_offsets[:-1]).long()
    tile_lengths = (tile_offsets[1:] - tile_offsets[:-1]).long()
    device, blocks = item_offsets.device, triton.cdiv(max(max_item_len, 1), item_block)
    block_starts = torch.arange(blocks, device=device) * item_block
    per_item = ((tile_lengths + tile_block - 1) // tile_block).clamp_min(1)
    item_tiles = torch.where(block_starts[None, :] < item_lengths[:, None], per_item[:, None], 0)
    tiles = item_tiles[:, :, None].expand(-1, -1, num_heads).reshape(-1)
    order = torch.argsort(tiles, descending=True, stable=True)
    ordered = tiles[order]
    ends = ordered.cumsum(0)
    begins = ends - ordered
    cost = ordered + (ordered > 0)  # a tile counts 1, an item 1 more
    cost_ends = cost.cumsum(0)
    num_entries = tiles.numel() * triton.cdiv(max(max_tile_len, 1), tile_block)
    entries = torch.arange(num_entries, device=device)
    position = torch.searchsorted(ends, entries, right=True).clamp_max(tiles.numel() - 1)
    tile_item = order[position].to(torch.int32)
    tile_index = (entries - begins[position]).to(torch.int32)
    # each run starts at the first item whose cost begins at or after its share of the total
    targets = torch.arange(num_runs + 1, device=device) * cost_ends[-1] // num_runs
    first_item = torch.searchsorted(cost_ends - cost, targets)
    run_start = torch.where(first_item < tiles.numel(), begins[first_item.clamp_max(tiles.numel() - 1)], ends[-1])
    run_start[-1] = ends[-1]
    return tile_item, tile_index, run_start.to(torch.int32)


def resolve_schedule(schedule, num_runs: int | None, q: torch.Tensor, *sides) -> tuple[int, tuple]:
    """``(num_runs, schedule)`` of a persistent kernel's launch: ``num_runs`` by default one per SM
    (4 off a GPU); ``schedule`` built by ``persistent_schedule(*sides, H, ..., num_runs)`` when None
    (``sides``: its arguments but the heads and the runs), else checked against ``num_runs``."""
    if num_runs is None:
        num_runs = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    if schedule is None:
        *offsets_and_lengths, item_block, tile_block = sides
        schedule = persistent_schedule(*offsets_and_lengths, q.shape[1], item_block, tile_block, num_runs)
    if schedule[2].numel() != num_runs + 1:
        raise ValueError(f"schedule has {schedule[2].numel() - 1} runs, num_runs is {num_runs}")
    return num_runs, schedule


def persistent_softmax_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    scale: float | None = None,
    *,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    num_runs: int | None = None,
    schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap=identity,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of jagged rows, no mask: ``out [Tq, H, D]`` and ``lse [H, Tq]`` (float32,
    log2 units; ``+inf`` and an output of 0 for a query without keys), as ``triton_fwd.forward``
    computes them; no gradient.

    Args:
        q: ``[Tq, H, D]`` (``q_offsets [B+1]``, lengths at most ``max_q_len``); k, v: ``[Tk, H, D]``
            (``kv_offsets``, ``max_kv_len``); last dimension contiguous.
        scale: of the scores (default ``1 / sqrt(D)``).
        block_m, block_n, num_warps, num_stages: the launch config (no autotuning yet).
        num_runs: programs launched (default one per SM, :func:`resolve_schedule`: 128 x 64 tiles in two stages
            fill an SM's shared memory).
        schedule: ``persistent_schedule(q_offsets, kv_offsets, max_q_len, max_kv_len, H, block_m,
            block_n, num_runs)`` (computed here when None; one batch's layers can share it).
        wrap: ``torch.library.wrap_triton`` or a compile-only stand-in.
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[1:] != q.shape[1:]:
        raise ValueError(
            f"q must be [Tq, H, D] and k, v [Tk, H, D] alike, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    num_rows, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = q.new_empty(q.shape)
    lse = q.new_empty((num_heads, num_rows), dtype=torch.float32)
    if num_rows == 0 or num_heads == 0 or max_q_len == 0 or q_offsets.numel() < 2:
        return out.zero_(), lse.fill_(float("inf"))
    num_runs, (tile_item, tile_index, run_start) = resolve_schedule(
        schedule, num_runs, q, q_offsets, kv_offsets, max_q_len, max_kv_len, block_m, block_n
    )
    block_d = max(triton.next_power_of_2(head_dim), 16)
    wrap(_persistent_fwd_kernel)[(num_runs,)](
        q,
        k,
        v,
        out,
        lse,
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
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        num_heads,
        head_dim,
        triton.cdiv(max_q_len, block_m),
        scale * LOG2E,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse
