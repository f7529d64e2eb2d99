"""What the Hopper (sm_90) Gluon kernels share: when they apply, their work list, tile stores.

Both Gluon kernels (``gluon_fwd.py``: the GDPA forward; ``gluon_bwd.py``: the stored-dS
backward's dK/dV) are persistent: one program per SM loops over a compact list of work tiles
(128 rows of one example and head) built on the GPU by :func:`work_list` without a host sync,
examples in ``batch_order`` (most work first), then row blocks, then heads. ``call.py`` decides
when they run (:func:`applies`, ``settings.gluon`` / ``settings.gluon_bwd``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kernels.jagged_attention import triton_common as tc

BLOCK_M = 128  # rows per work tile: two consumers of 64
CONSUMER_REGS = 232  # registers per consumer thread after setmaxnreg (the loader keeps 24)
# int32 per work tile: first row, valid rows, head, K/V (or Q) start, length, 3 zeros
WORK_FIELDS = gl.constexpr(8)
HEAD_DIMS = (64, 128)
SOFTMAX, SILU, GELU, FAST_GELU, RELU = (
    gl.constexpr(code) for code in (tc.SOFTMAX, tc.SILU, tc.GELU, tc.FAST_GELU, tc.RELU)
)


_checking = False  # real tensors while Dynamo traces: a build check's (``real_tensors``)


@contextlib.contextmanager
def real_tensors():
    """Around a build check that Dynamo calls while it traces (``kernels.fallback.gluon_checked``):
    its tensors are real, so :func:`tensors_apply` judges them as in an eager call."""
    global _checking
    saved, _checking = _checking, True
    try:
        yield
    finally:
        _checking = saved


def applies(q, k, v, activation, causal, window, block_size, q_broadcast) -> bool:
    """Whether the Gluon kernels take a GDPA call: a pointwise activation without a causal,
    window or block mask, jagged queries, and tensors as :func:`tensors_apply` asks."""
    return tc.unmasked_pointwise(activation, causal, window, block_size, q_broadcast) and tensors_apply(q, k, v)


def tensors_apply(q, k, v) -> bool:
    """Real (not traced) 16-bit CUDA tensors on an sm_90 GPU, head dim 64 or 128, non-empty
    ``[rows, H, D]`` tensors that a 2-D descriptor over ``[rows, H * D]`` can address (heads
    adjacent, 16-byte aligned base and row stride)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not real(q, k, v):
        return False
    if tc.capability(q.device.index)[0] != 9:
        return False
    return q.shape[2] in HEAD_DIMS and all(t.dtype == q.dtype and addressable(t) for t in (q, k, v))


def real(*tensors) -> bool:
    """Real tensors: not traced by torch.compile (but a build check's, :func:`real_tensors`), not fake."""
    return not (torch.compiler.is_compiling() and not _checking) and not any(is_fake(t) for t in tensors)


def addressable(t) -> bool:
    """Whether a 2-D descriptor over ``[rows, H * D]`` can address the ``[rows, H, D]`` tensor t:
    heads adjacent, 16-byte aligned base and row stride, 1 to 2^31 - 1 rows."""
    return (
        t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and t.stride(0) * t.element_size() % 16 == 0
        and 0 < t.shape[0] < 2**31
    )


@triton.jit
def _work_list_kernel(
    q_offsets,
    kv_offsets,
    batch_order,
    WORK,
    TOTAL,
    num_batches,
    num_heads,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    FIELDS: tl.constexpr,
):
    """Program (m, h) writes the work tiles of query block m and head h of every example:
    ``WORK[e]`` = (first Q row, valid rows, head, K/V start, K/V length, 0, 0, 0) for tile
    ``e`` = (blocks of the examples before it in ``batch_order`` + m) * heads + h, one 32-byte
    row store per tile (faster than a store per field; docs/log/kernels.md). Program (0, 0)
    writes their number to ``TOTAL``."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    field = tl.arange(0, FIELDS)[None, :]
    carry = 0
    for c0 in range(0, num_batches, CHUNK):
        rank = c0 + tl.arange(0, CHUNK)
        valid = rank < num_batches
        b = tl.load(batch_order + rank, mask=valid, other=0)
        q_start = tl.load(q_offsets + b, mask=valid, other=0).to(tl.int32)
        q_len = tl.load(q_offsets + b + 1, mask=valid, other=0).to(tl.int32) - q_start
        kv_start = tl.load(kv_offsets + b, mask=valid, other=0).to(tl.int32)
        kv_len = tl.load(kv_offsets + b + 1, mask=valid, other=0).to(tl.int32) - kv_start
        blocks = tl.where(valid, tl.cdiv(q_len, BLOCK_M), 0)
        tile = (carry + tl.cumsum(blocks, 0) - blocks + m) * num_heads + h
        entry = tl.where(
            field == 0,
            (q_start + m * BLOCK_M)[:, None],
            tl.where(
                field == 1,
                (q_len - m * BLOCK_M)[:, None],
                tl.where(
                    field == 2, h, tl.where(field == 3, kv_start[:, None], tl.where(field == 4, kv_len[:, None], 0))
                ),
            ),
        )
        tl.store(WORK + tile.to(tl.int64)[:, None] * FIELDS + field, entry, mask=(m < blocks)[:, None])
        carry += tl.sum(blocks, 0)
    if m == 0 and h == 0:
        tl.store(TOTAL, carry * num_heads)


@gluon.jit
def work_tile(WORK, t, valid):
    """Work tile t of the list (zeros where not ``valid``)."""
    row = WORK + t.to(gl.int64) * WORK_FIELDS
    return (
        gl.load(row, mask=valid, other=0),
        gl.load(row + 1, mask=valid, other=0),
        gl.load(row + 2, mask=valid, other=0),
        gl.load(row + 3, mask=valid, other=0),
        gl.load(row + 4, mask=valid, other=0),
    )


@gluon.jit
def store_tile(tile, X, desc, buf, row0, col0, num_rows, stride_row):
    """Stores rows ``0 .. num_rows - 1`` of ``tile`` (in registers, the output dtype) at rows
    ``row0 + i`` and columns ``col0 ..`` of the 2-D tensor that ``desc`` addresses (``X``:
    its column ``col0`` of row 0; ``stride_row`` its row stride), through the shared buffer
    ``buf``: one TMA store when every row is to be stored, else masked stores of 16 bytes per
    thread (the descriptor's rows run on into the next example). The TMA store is left in
    flight; the next call, and the caller before it reuses ``buf`` or ends, wait for it.

    (Straight from the accumulator's registers, 4-byte pieces per thread, the stores cost the
    short rows much of their time; docs/log/kernels.md.)"""
    BLOCK_C: gl.constexpr = tile.shape[1]
    tma.store_wait(0)
    buf.store(tile)
    fence_async_shared()
    if num_rows >= tile.shape[0]:
        tma.async_copy_shared_to_global(desc, [row0, col0], buf)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [4, 1], [1, 0])
        values = buf.load(layout)
        rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        offs = (row0 + rows).to(gl.int64)[:, None] * stride_row + cols[None, :]
        gl.store(X + offs, values, mask=(rows < num_rows)[:, None] & (cols < BLOCK_C)[None, :])


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def work_list(
    q_offsets, kv_offsets, batch_order, num_heads, max_q_len, wrap=lambda kernel: kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's work tiles, computed on the device without a host sync: ``work[:total]``
    (``[bound, 8]`` int32; ``bound`` counts ``max_q_len``'s blocks for every example) and
    ``total`` (one int32), see :func:`_work_list_kernel`."""
    num_batches = kv_offsets.numel() - 1
    max_q_blocks = triton.cdiv(max_q_len, BLOCK_M)
    bound = num_batches * num_heads * max_q_blocks
    work = torch.empty(bound, WORK_FIELDS.value, dtype=torch.int32, device=q_offsets.device)
    total = torch.zeros(1, dtype=torch.int32, device=q_offsets.device)
    if max_q_blocks > 0 and num_heads > 0:
        wrap(_work_list_kernel)[(max_q_blocks, num_heads)](
            q_offsets,
            kv_offsets,
            batch_order,
            work,
            total,
            num_batches,
            num_heads,
            BLOCK_M=BLOCK_M,
            CHUNK=1024,
            FIELDS=WORK_FIELDS,
        )
    return work, total
