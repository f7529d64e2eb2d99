"""The order in which the kernels' programs take the examples: most work first.

Longest example first, so the short and empty examples fill the tail of the grid instead of
leaving long ones to run alone. Up to ``COUNTING_ORDER_MAX_BATCHES`` examples the order comes from
a counting kernel, above it from ``torch.argsort`` (measurements in docs/log/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.triton_common import identity

# Up to here the counting kernel beat computing the work and argsorting it (docs/log/kernels.md).
COUNTING_ORDER_MAX_BATCHES = 8192


@triton.jit
def _work(q_start, q_end, kv_start, kv_end):
    """Query rows x keys of an example (int64), from its offsets. It takes loaded values, not
    pointers: Inductor counts a pointer passed to a helper whose result feeds a store address as
    written, and clones it (tests/kernels/compile_mutations.py)."""
    return (q_end - q_start).to(tl.int64) * (kv_end - kv_start).to(tl.int64)


@triton.jit
def _batch_order_kernel(q_offsets, kv_offsets, ORDER, num_batches, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """``ORDER[rank] = example``, most work (query rows x keys) first, ties in index order:
    the stable descending argsort, by counting for each example the examples ranked before it
    (quadratic, so only for batches up to ``COUNTING_ORDER_MAX_BATCHES``)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mine = i < num_batches
    work_i = _work(
        tl.load(q_offsets + i, mask=mine, other=0),
        tl.load(q_offsets + i + 1, mask=mine, other=0),
        tl.load(kv_offsets + i, mask=mine, other=0),
        tl.load(kv_offsets + i + 1, mask=mine, other=0),
    )
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, num_batches, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        theirs = j < num_batches
        work_j = _work(
            tl.load(q_offsets + j, mask=theirs, other=0),
            tl.load(q_offsets + j + 1, mask=theirs, other=0),
            tl.load(kv_offsets + j, mask=theirs, other=0),
            tl.load(kv_offsets + j + 1, mask=theirs, other=0),
        )
        work_j = tl.where(theirs, work_j, -1)  # never first
        before = (work_j[None, :] > work_i[:, None]) | (
            (work_j[None, :] == work_i[:, None]) & (j[None, :] < i[:, None])
        )
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(ORDER + rank, i, mask=mine)


def batch_order(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    wrap=identity,
    max_counting_batches: int = COUNTING_ORDER_MAX_BATCHES,
) -> torch.Tensor:
    """``[B]`` int32: the examples by work (query rows x keys), most first, ties in index
    order, i.e. ``argsort(work, descending=True, stable=True)``; the order in which the
    kernels' programs take them. Above ``max_counting_batches`` examples, ``torch.argsort``."""
    num_batches = kv_offsets.numel() - 1
    if num_batches > max_counting_batches:
        work = (q_offsets[1:] - q_offsets[:-1]).long() * (kv_offsets[1:] - kv_offsets[:-1]).long()
        return torch.argsort(work, descending=True, stable=True).to(torch.int32)
    order = torch.empty(num_batches, dtype=torch.int32, device=q_offsets.device)
    if num_batches > 0:
        wrap(_batch_order_kernel)[(triton.cdiv(num_batches, 32),)](
            q_offsets, kv_offsets, order, num_batches, BLOCK_I=32, BLOCK_J=512
        )
    return order
