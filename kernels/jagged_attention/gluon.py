"""Hopper (sm_90) GDPA forward and dK/dV in Gluon: persistent and warp-specialized.

The forward is on by default (``GEM_KERNELS_GLUON=0`` turns it off; ``triton.USE_GLUON``; this
module is imported at the first GDPA forward): :func:`applies` says when the forward launcher in
``triton.py`` can take this kernel instead of its Triton one, and it does for ``max_q_len``
above ``triton.GLUON_MIN_Q_LEN`` (128; there the Triton forward measured faster). Same math as
the Triton forward (``_gdpa_act`` / ``_gdpa_act_packed``, the output scale folded by the
launcher), so the two agree to rounding. The dK/dV kernel (:func:`dkdv`, at the end) is
described there.

Structure (FlashAttention-3's forward, for a pointwise activation):

* One program per SM loops over a compact list of work tiles (128 query rows of one example
  and head), built on the GPU by :func:`_work_list_kernel` without a host sync: examples in
  ``batch_order`` (most work first), then query blocks, then heads. Programs stride through the
  list, so every SM gets a mix of long and short tiles.
* Per program, one loader warp issues TMA copies (Q tiles double-buffered, K/V through a ring
  of ``STAGES`` slots) from host-built tensor descriptors over ``[rows, H * D]``, while two
  4-warp consumers each own 64 of the tile's 128 query rows and share the K/V ring. A consumer
  issues ``S_j = Q K_j^T`` and ``P_{j-1} V_{j-1}`` back to back, so the tensor cores run one
  while its warps compute the activation of the other. The pipeline runs on across tiles: a
  tile's last ``P V`` goes out with the next tile's first ``Q K^T``, and its output is stored
  after it.
* A descriptor's rows run on into the next example: the last key tile of an example is masked
  in registers (columns past its end give ``P = 0``), and a consumer's 64 output rows go through
  shared memory, by TMA where all are the example's and by masked 16-byte stores else. Rows
  past the tensor's end are zero-filled by the TMA unit.

Measured on an H200 against the Triton forward (fast_gelu, bf16, head dim 128, fill 0.5):
3-5% slower at 128 rows, 5-15% faster at 256, 14-19% at 512, 10-21% at 1024, 18-21% at 2048
(``benchmarks/attention.py --lengths``; docs/kernels.md, "What moved GDPA this time" and "The
Gluon forward"); tested on the GPU by ``test_gpu_gluon_forward*``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.jagged_attention import triton as tk
from kernels.jagged_attention.triton import FAST_GELU_BF16X2, SILU_BF16X2

BLOCK_M = 128  # query rows per work tile: two consumers of 64
BLOCK_N = 64
STAGES = 4  # K/V ring slots
Q_BUFFERS = 2  # Q tiles in flight: the next tile's loads overlap the current one's epilogue
CONSUMER_REGS = 232  # registers per consumer thread after setmaxnreg (the loader keeps 24)
# int32 per work tile: first Q row, valid rows, head, K/V start, K/V length, 3 zeros
WORK_FIELDS = gl.constexpr(8)
HEAD_DIMS = (64, 128)
SILU, GELU, FAST_GELU, RELU = (gl.constexpr(code) for code in (tk.SILU, tk.GELU, tk.FAST_GELU, tk.RELU))


def applies(q, k, v, activation, causal, window, block_size, q_broadcast) -> bool:
    """Whether this kernel computes the forward: real (not traced) 16-bit CUDA tensors on an sm_90
    GPU, a pointwise activation without a causal, window or block mask, jagged queries, head dim
    64 or 128, and non-empty ``[rows, H, D]`` tensors that a 2-D descriptor over ``[rows, H * D]``
    can address (heads adjacent, 16-byte aligned base and row stride)."""
    if activation == "softmax" or causal or window >= 0 or block_size > 0:
        return False
    if q_broadcast or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.compiler.is_compiling() or any(is_fake(t) for t in (q, k, v)):
        return False
    if tk._capability(q.device.index)[0] != 9:
        return False
    return q.shape[2] in HEAD_DIMS and all(
        t.dtype == q.dtype and _addressable(t) for t in (q, k, v))


def _addressable(t) -> bool:
    """Whether a 2-D descriptor over ``[rows, H * D]`` can address the ``[rows, H, D]`` tensor t:
    heads adjacent, 16-byte aligned base and row stride, 1 to 2^31 - 1 rows."""
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
            and t.stride(0) * t.element_size() % 16 == 0 and 0 < t.shape[0] < 2**31)


@triton.jit
def _work_list_kernel(q_offsets, kv_offsets, batch_order, WORK, TOTAL, num_batches, num_heads,
                      BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FIELDS: tl.constexpr):
    """Program (m, h) writes the work tiles of query block m and head h of every example:
    ``WORK[e]`` = (first Q row, valid rows, head, K/V start, K/V length, 0, 0, 0) for tile
    ``e`` = (blocks of the examples before it in ``batch_order`` + m) * heads + h, one 32-byte
    row store per tile. (One program per m storing each field apart took 31 us at 1,152
    examples and 186 us at 8,192 on an H200, against 21 and 28 us; do_bench, launches
    included.) Program (0, 0) writes their number to ``TOTAL``."""
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
        entry = tl.where(field == 0, (q_start + m * BLOCK_M)[:, None],
                tl.where(field == 1, (q_len - m * BLOCK_M)[:, None],
                tl.where(field == 2, h,
                tl.where(field == 3, kv_start[:, None],
                tl.where(field == 4, kv_len[:, None], 0)))))
        tl.store(WORK + tile.to(tl.int64)[:, None] * FIELDS + field, entry,
                 mask=(m < blocks)[:, None])
        carry += tl.sum(blocks, 0)
    if m == 0 and h == 0:
        tl.store(TOTAL, carry * num_heads)


@gluon.jit
def _tanh(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _activation(s, scale, ACTIVATION: gl.constexpr, PACKED: gl.constexpr, dtype: gl.constexpr):
    """P of the float32 scores s, in ``dtype``: triton.py's ``_gdpa_act`` (FAST) or, where
    PACKED (bf16 silu / fast_gelu), ``_gdpa_act_packed``."""
    if PACKED:
        x = s.to(dtype)
        if ACTIVATION == SILU:
            h = gl.full(x.shape, 0.5 * scale, dtype, x.type.layout)
            return gl.inline_asm_elementwise(SILU_BF16X2, "=r,r,r", [x, h], dtype=x.dtype,
                                             is_pure=True, pack=2)
        a = scale * 0.7978845608028654
        a2 = gl.full(x.shape, a, dtype, x.type.layout)
        b2 = gl.full(x.shape, a * 0.044715 * scale * scale, dtype, x.type.layout)
        return gl.inline_asm_elementwise(FAST_GELU_BF16X2, "=r,r,r,r", [x, a2, b2],
                                         dtype=x.dtype, is_pure=True, pack=2)
    if ACTIVATION == SILU:
        p = s + s * _tanh(s * (0.5 * scale))
    elif ACTIVATION == GELU:
        p = s + s * gl.erf(s * (scale * 0.7071067811865476))
    elif ACTIVATION == FAST_GELU:
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        p = s + s * _tanh(s * (a + b * (s * s)))
    elif ACTIVATION == RELU:
        p = gl.maximum(s, 0.0)
    else:
        p = s
    return p.to(dtype)


@gluon.jit
def _probabilities(s, j, kv_len, scale, p_layout: gl.constexpr, ACTIVATION: gl.constexpr,
                   PACKED: gl.constexpr, dtype: gl.constexpr):
    """P of key tile j as the A operand of P V; the example's last tile zeroes the columns past
    its end (they hold the next example's keys)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    p = _activation(s, scale, ACTIVATION, PACKED, dtype)
    if (j + 1) * BLOCK_N > kv_len:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        p = gl.where((cols < kv_len - j * BLOCK_N)[None, :], p, gl.zeros_like(p))
    return gl.convert_layout(p, p_layout)


@gluon.jit
def _tile(WORK, t, valid):
    """Work tile t of the list (zeros where not ``valid``)."""
    row = WORK + t.to(gl.int64) * WORK_FIELDS
    return (gl.load(row, mask=valid, other=0), gl.load(row + 1, mask=valid, other=0),
            gl.load(row + 2, mask=valid, other=0), gl.load(row + 3, mask=valid, other=0),
            gl.load(row + 4, mask=valid, other=0))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free,
            WORK, TOTAL):
    """The loader warp: for each of the program's tiles, its two Q halves (once a Q buffer is
    free), then its K/V tiles into the ring (once both consumers released the slot)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // 2
    total = gl.load(TOTAL)
    it = 0  # K/V tiles loaded so far
    done = 0  # work tiles loaded so far
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        row0, num_rows, h, kv_start, kv_len = _tile(WORK, t, True)
        qb = done % Q_BUFFERS
        mbarrier.wait(q_free.index(qb), phase=((done // Q_BUFFERS) + 1) & 1, pred=done >= Q_BUFFERS)
        bar = q_ready.index(qb)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0, h * HEAD_D], bar, q_smem.index(2 * qb))
        tma.async_copy_global_to_shared(q_desc, [row0 + 64, h * HEAD_D], bar, q_smem.index(2 * qb + 1))
        for j in range(gl.cdiv(kv_len, BLOCK_N)):
            slot = it % STAGES
            mbarrier.wait(kv_free.index(slot), phase=((it // STAGES) + 1) & 1, pred=it >= STAGES)
            bar = kv_ready.index(slot)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_start + j * BLOCK_N, h * HEAD_D], bar,
                                            k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [kv_start + j * BLOCK_N, h * HEAD_D], bar,
                                            v_smem.index(slot))
            it += 1
        done += 1


@gluon.jit
def _store_tile(tile, X, desc, buf, row0, col0, num_rows, stride_row):
    """Stores rows ``0 .. num_rows - 1`` of ``tile`` (in registers, the output dtype) at rows
    ``row0 + i`` and columns ``col0 ..`` of the 2-D tensor that ``desc`` addresses (``X``:
    its column ``col0`` of row 0; ``stride_row`` its row stride), through the shared buffer
    ``buf``: one TMA store when every row is to be stored, else masked stores of 16 bytes per
    thread (the descriptor's rows run on into the next example). The TMA store is left in
    flight; the next call, and the caller before it reuses ``buf`` or ends, wait for it.

    Stored straight from the accumulator's registers (4-byte pieces per thread), the output took
    about a fifth of the forward's time at 512 rows (fill 0.5) and pffn (docs/kernels.md)."""
    BLOCK_C: gl.constexpr = tile.shape[1]
    tma.store_wait(0)
    buf.store(tile)
    fence_async_shared()
    if num_rows >= tile.shape[0]:
        tma.async_copy_shared_to_global(desc, [row0, col0], buf)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8],
                                                [4, 1], [1, 0])
        values = buf.load(layout)
        rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        offs = (row0 + rows).to(gl.int64)[:, None] * stride_row + cols[None, :]
        gl.store(X + offs, values, mask=(rows < num_rows)[:, None] & (cols < BLOCK_C)[None, :])


@gluon.jit
def _epilogue(acc, O, o_desc, o_buf, row0, num_rows, h, stride_ot, stride_oh, out_scale,
              dtype: gl.constexpr):
    """Stores a consumer's 64 output rows (those below ``num_rows``), see :func:`_store_tile`."""
    _store_tile((acc * out_scale).to(dtype), O + h * stride_oh, o_desc, o_buf, row0,
                h * acc.shape[1], num_rows, stride_ot)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
              stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION: gl.constexpr,
              PACKED: gl.constexpr, HALF: gl.constexpr):
    """A 4-warp consumer: rows ``HALF * 64`` to ``HALF * 64 + 63`` of each of the program's work
    tiles. It reads the next tile's entry while it computes the current one.

    The software pipeline runs across tiles: a tile's last ``P V`` is issued after the next
    tile's first ``Q K^T`` (the tensor cores run it while the warps compute that tile's first
    activation), and its output is stored then. ``pending`` (0 or 1) says whether such a
    product is waiting; when none is, the step multiplies ``P = 0`` and stores nothing."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    p_zero = gl.zeros([64, BLOCK_N], dtype, p_layout)
    total = gl.load(TOTAL)
    step = gl.num_programs(0)
    o_buf = o_smem.index(HALF)
    it = 0
    done = 0
    # the tile whose last P V is pending: its P, K/V slot, output rows and head
    acc = o_zero
    p = p_zero
    pending = 0
    prev = 0
    out_row0 = 0
    out_rows = 0
    out_h = 0
    next_row0, next_rows, next_h, _, next_kv_len = _tile(WORK, gl.program_id(0),
                                                         gl.program_id(0) < total)
    for t in range(gl.program_id(0), total, step):
        row0 = next_row0 + HALF * 64
        num_rows = next_rows - HALF * 64
        h = next_h
        kv_len = next_kv_len
        next_row0, next_rows, next_h, _, next_kv_len = _tile(WORK, t + step, t + step < total)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        qb = done % Q_BUFFERS
        q = q_smem.index(2 * qb + HALF)
        mbarrier.wait(q_ready.index(qb), phase=(done // Q_BUFFERS) & 1)
        if n_tiles > 0:
            slot = it % STAGES
            if pending == 0:
                prev = slot  # a ready slot for the P = 0 product
            mbarrier.wait(kv_ready.index(slot), phase=(it // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            p_next = _probabilities(s, 0, kv_len, scale, p_layout, ACTIVATION, PACKED, dtype)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
            _epilogue(acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot,
                      stride_oh, out_scale, dtype)
            acc = o_zero
            p = p_next
            for j in range(1, n_tiles):
                c = it + j
                slot = c % STAGES
                prev = (c - 1) % STAGES
                mbarrier.wait(kv_ready.index(slot), phase=(c // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s,))
                p_next = _probabilities(s, j, kv_len, scale, p_layout, ACTIVATION, PACKED, dtype)
                acc, p = warpgroup_mma_wait(0, deps=(acc, p))
                mbarrier.arrive(kv_free.index(prev), count=1)
                p = p_next
            mbarrier.arrive(q_free.index(qb), count=1)
            prev = (it + n_tiles - 1) % STAGES
            it += n_tiles
            pending = 1
            out_row0 = row0
            out_rows = num_rows
            out_h = h
        else:  # no keys: flush the pending product, then store zeros
            mbarrier.arrive(q_free.index(qb), count=1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
            _epilogue(acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot,
                      stride_oh, out_scale, dtype)
            _epilogue(o_zero, O, o_desc, o_buf, row0, num_rows, h, stride_ot, stride_oh,
                      out_scale, dtype)
            acc = o_zero
            p = p_zero
            pending = 0
        done += 1
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
    _epilogue(acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot, stride_oh,
              out_scale, dtype)
    tma.store_wait(0)


# warp_specialize passes its partitions runtime values only, so each half gets its own entry.
@gluon.jit
def _consumer0(q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
               stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION: gl.constexpr,
               PACKED: gl.constexpr):
    _consumer(q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
              stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION, PACKED, 0)


@gluon.jit
def _consumer1(q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
               stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION: gl.constexpr,
               PACKED: gl.constexpr):
    _consumer(q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
              stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION, PACKED, 1)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _gdpa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, WORK, TOTAL, stride_ot, stride_oh, scale,
                     out_scale, ACTIVATION: gl.constexpr, PACKED: gl.constexpr,
                     HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     Q_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_D], o_desc.layout)  # one per consumer
    q_ready = _barriers(Q_BUFFERS, 1)
    q_free = _barriers(Q_BUFFERS, 2)
    kv_ready = _barriers(STAGES, 1)
    kv_free = _barriers(STAGES, 2)
    consumer_args = (q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, O, o_desc, o_smem,
                     stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION, PACKED)
    gl.warp_specialize([
        (_consumer0, consumer_args),
        (_consumer1, consumer_args),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, kv_ready,
                   kv_free, WORK, TOTAL)),
    ], [4, 1], [CONSUMER_REGS, 24])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def work_list(q_offsets, kv_offsets, batch_order, num_heads, max_q_len,
              wrap=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor]:
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
            q_offsets, kv_offsets, batch_order, work, total, num_batches, num_heads,
            BLOCK_M=BLOCK_M, CHUNK=1024, FIELDS=WORK_FIELDS)
    return work, total


def forward(q, k, v, out, q_offsets, kv_offsets, batch_order, max_q_len, activation_code, scale,
            out_scale, packed, wrap=lambda kernel: kernel, num_sms=None) -> None:
    """Writes the GDPA forward of ``[rows, H, D]`` q, k, v into ``out`` (see :func:`applies`),
    which must be shaped as q, with the layout :func:`applies` asks of q (the output's TMA stores
    address it as ``[rows, H * D]``).

    ``out_scale`` is the launcher's ``post_scale * ACT_UNIT * scale``; ``num_sms`` (the grid
    size; default, the GPU's SM count) and ``wrap`` (see ``triton.py``) let tests compile
    without launching."""
    if out.shape != q.shape or not _addressable(out):
        raise ValueError(f"gluon.forward: out must have q's shape {tuple(q.shape)}, adjacent heads "
                         f"and 16-byte aligned rows; got shape {tuple(out.shape)}, strides "
                         f"{out.stride()}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    work, total = work_list(q_offsets, kv_offsets, batch_order, num_heads, max_q_len, wrap)

    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], element)

    def descriptor(t, block_rows, layout):
        return TensorDescriptor(t, [t.shape[0], num_heads * head_dim], [t.stride(0), 1],
                                [block_rows, head_dim], layout)

    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device() if q.device.index is None else q.device.index)
    wrap(_gdpa_fwd_kernel)[(max(1, min(work.shape[0], num_sms)),)](
        descriptor(q, 64, q_layout), descriptor(k, BLOCK_N, kv_layout),
        descriptor(v, BLOCK_N, kv_layout), descriptor(out, 64, q_layout), out, work, total,
        out.stride(0), out.stride(1), scale, out_scale, ACTIVATION=activation_code, PACKED=packed,
        HEAD_D=head_dim, BLOCK_N=BLOCK_N, STAGES=STAGES, Q_BUFFERS=Q_BUFFERS,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4)


# ---------------------------------------------------------------------------------------
# backward: dK, dV and the stored dS
#
# On by default (GEM_KERNELS_GLUON_BWD=0 turns it off; triton._gluon_dkdv says when it runs):
# the stored-dS backward's dK/dV kernel for bf16 silu and fast_gelu (the bf16x2 activation path)
# where :func:`applies` holds. The forward's structure with the roles of queries and keys
# swapped: a work tile is 128 keys of one example and head (the forward's work list built over
# the keys), two 4-warp consumers of 64 keys each, a loader warp that loads a tile's K and V
# into one of two buffers (the next tile's load overlaps this one's steps) and streams Q and dO
# tiles of BWD_BLOCK_M rows through a ring. dK and dV leave through the K and V buffers they
# replace, dS through a small buffer per consumer, by TMA where a consumer's 64 keys are all
# the example's. Same math, order of products and tile sizes as the Triton dK/dV kernel's
# autotuned choice at the short rows (32 queries per step): on an H200 the gradients came out
# identical to it. The Triton dQ kernel then reads dS.
# ---------------------------------------------------------------------------------------

BWD_BLOCK_M = 32  # query rows per step
BWD_STAGES = 4  # Q/dO ring slots


@gluon.jit
def _grads(st, dpt, j, q_len, scale, ACTIVATION: gl.constexpr):
    """(P^T, dS^T) of step j from the float32 ``S^T`` and ``dP^T`` tiles ([keys, queries]), in
    bf16: triton.py's ``_gdpa_act_and_grad_packed``. Query columns past the example's end (the
    next example's rows) give zeros."""
    BLOCK_M: gl.constexpr = st.shape[1]
    layout: gl.constexpr = st.type.layout
    x = st.to(gl.bfloat16)
    dp = dpt.to(gl.bfloat16)
    if ACTIVATION == SILU:
        h = gl.full(x.shape, 0.5 * scale, gl.bfloat16, layout)
        p, ds = gl.inline_asm_elementwise(tk.SILU_GRAD_BF16X2, "=r,=r,r,r,r", [x, dp, h],
                                          dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
    else:
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        a2 = gl.full(x.shape, a, gl.bfloat16, layout)
        b2 = gl.full(x.shape, b, gl.bfloat16, layout)
        b3 = gl.full(x.shape, 3.0 * b, gl.bfloat16, layout)
        p, ds = gl.inline_asm_elementwise(tk.FAST_GELU_GRAD_BF16X2, "=r,=r,r,r,r,r,r",
                                          [x, dp, a2, b2, b3], dtype=(gl.bfloat16, gl.bfloat16),
                                          is_pure=True, pack=2)
    if (j + 1) * BLOCK_M > q_len:
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        keep = (cols < q_len - j * BLOCK_M)[None, :]
        p = gl.where(keep, p, gl.zeros_like(p))
        ds = gl.where(keep, ds, gl.zeros_like(ds))
    return p, ds


@gluon.jit
def _dkdv_loader(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready,
                 kv_free, ready, free, WORK, TOTAL):
    """The backward's loader warp: for each of the program's tiles, its K and V halves into one
    of two buffers (once both consumers released it), then its Q and dO tiles into the ring."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    total = gl.load(TOTAL)
    it = 0  # Q/dO tiles loaded so far
    done = 0  # work tiles loaded so far
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        row0, num_keys, h, q_start, q_len = _tile(WORK, t, True)
        b = done % 2
        mbarrier.wait(kv_free.index(b), phase=((done // 2) + 1) & 1, pred=done >= 2)
        bar = kv_ready.index(b)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [row0 + half * 64, h * HEAD_D], bar,
                                            k_smem.index(2 * b + half))
            tma.async_copy_global_to_shared(v_desc, [row0 + half * 64, h * HEAD_D], bar,
                                            v_smem.index(2 * b + half))
        for j in range(gl.cdiv(q_len, BLOCK_M)):
            slot = it % STAGES
            mbarrier.wait(free.index(slot), phase=((it // STAGES) + 1) & 1, pred=it >= STAGES)
            bar = ready.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + j * BLOCK_M, h * HEAD_D], bar,
                                            q_smem.index(slot))
            tma.async_copy_global_to_shared(do_desc, [q_start + j * BLOCK_M, h * HEAD_D], bar,
                                            do_smem.index(slot))
            it += 1
        done += 1


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                   DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                   kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION: gl.constexpr,
                   HALF: gl.constexpr):
    """A 4-warp consumer: keys ``HALF * 64`` to ``HALF * 64 + 63`` of each of the program's work
    tiles. Per step it issues ``S^T = K Q^T`` and ``dP^T = V dO^T``, then the previous step's
    ``dV += P^T dO`` and ``dK += dS^T Q``, and computes this step's P and dS (and stores dS)
    while those two run. dK and dV go out through the tile's K and V buffers."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    o_zero = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    ds_buf = ds_smem.index(HALF)
    total = gl.load(TOTAL)
    step = gl.num_programs(0)
    it = 0
    done = 0
    next_row0, next_keys, next_h, _, next_q_len = _tile(WORK, gl.program_id(0),
                                                        gl.program_id(0) < total)
    for t in range(gl.program_id(0), total, step):
        row0 = next_row0 + HALF * 64
        num_keys = next_keys - HALF * 64
        h = next_h
        q_len = next_q_len
        next_row0, next_keys, next_h, _, next_q_len = _tile(WORK, t + step, t + step < total)
        b = done % 2
        k = k_smem.index(2 * b + HALF)
        v = v_smem.index(2 * b + HALF)
        ds_row0 = h * kv_rows + row0  # dS viewed as [heads * K/V rows, padded queries]
        n_steps = gl.cdiv(q_len, BLOCK_M)
        dk = o_zero
        dv = o_zero
        mbarrier.wait(kv_ready.index(b), phase=(done // 2) & 1)
        if n_steps > 0:
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), phase=(it // STAGES) & 1)
            st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            dpt = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
            p, ds = _grads(st, dpt, 0, q_len, scale, ACTIVATION)
            _store_tile(ds, DS, ds_desc, ds_buf, ds_row0, 0, num_keys, stride_dst)
            p = gl.convert_layout(p, a_layout)
            ds = gl.convert_layout(ds, a_layout)
            for j in range(1, n_steps):
                c = it + j
                slot = c % STAGES
                prev = (c - 1) % STAGES
                mbarrier.wait(ready.index(slot), phase=(c // STAGES) & 1)
                st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)
                dpt = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), s_zero,
                                    use_acc=False, is_async=True)
                dv = warpgroup_mma(p, do_smem.index(prev), dv, is_async=True)
                dk = warpgroup_mma(ds, q_smem.index(prev), dk, is_async=True)
                st, dpt = warpgroup_mma_wait(2, deps=(st, dpt))
                p_next, ds_next = _grads(st, dpt, j, q_len, scale, ACTIVATION)
                dv, dk, p, ds = warpgroup_mma_wait(0, deps=(dv, dk, p, ds))
                mbarrier.arrive(free.index(prev), count=1)
                _store_tile(ds_next, DS + j * BLOCK_M, ds_desc, ds_buf, ds_row0, j * BLOCK_M,
                            num_keys, stride_dst)
                p = gl.convert_layout(p_next, a_layout)
                ds = gl.convert_layout(ds_next, a_layout)
            last = (it + n_steps - 1) % STAGES
            dv = warpgroup_mma(p, do_smem.index(last), dv, is_async=True)
            dk = warpgroup_mma(ds, q_smem.index(last), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(free.index(last), count=1)
            it += n_steps
        # every product that read this tile's K and V is complete: they take dK and dV
        _store_tile((dk * dk_scale).to(dtype), DK + h * HEAD_D, dk_desc, k, row0, h * HEAD_D,
                    num_keys, stride_dkt)
        _store_tile((dv * dv_scale).to(dtype), DV + h * HEAD_D, dv_desc, v, row0, h * HEAD_D,
                    num_keys, stride_dvt)
        tma.store_wait(0)
        mbarrier.arrive(kv_free.index(b), count=1)
        done += 1


@gluon.jit
def _dkdv_consumer0(k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                    DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                    kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION: gl.constexpr):
    _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                   DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                   kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION, 0)


@gluon.jit
def _dkdv_consumer1(k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                    DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                    kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION: gl.constexpr):
    _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                   DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                   kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION, 1)


@gluon.jit
def _gdpa_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, dk_desc, dv_desc, ds_desc, DK, DV, DS,
                      WORK, TOTAL, stride_dkt, stride_dvt, stride_dst, kv_rows, scale, dk_scale,
                      dv_scale, ACTIVATION: gl.constexpr, HEAD_D: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [4, 64, HEAD_D], k_desc.layout)  # 2 tiles x halves
    v_smem = gl.allocate_shared_memory(dtype, [4, 64, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_M], ds_desc.layout)  # per consumer
    kv_ready = _barriers(2, 1)
    kv_free = _barriers(2, 2)
    ready = _barriers(STAGES, 1)
    free = _barriers(STAGES, 2)
    consumer_args = (k_smem, v_smem, q_smem, do_smem, ds_smem, kv_ready, kv_free, ready, free,
                     DK, DV, DS, dk_desc, dv_desc, ds_desc, stride_dkt, stride_dvt, stride_dst,
                     kv_rows, WORK, TOTAL, scale, dk_scale, dv_scale, ACTIVATION)
    gl.warp_specialize([
        (_dkdv_consumer0, consumer_args),
        (_dkdv_consumer1, consumer_args),
        (_dkdv_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem,
                        kv_ready, kv_free, ready, free, WORK, TOTAL)),
    ], [4, 1], [CONSUMER_REGS, 24])


def dkdv(q, k, v, grad_out, dk, dv, ds, q_offsets, kv_offsets, batch_order, max_kv_len,
         activation_code, scale, dk_scale, dv_scale, wrap=lambda kernel: kernel, num_sms=None,
         block_m=BWD_BLOCK_M, stages=BWD_STAGES) -> None:
    """Writes dK, dV and the stored dS (``ds``: ``[H, K/V rows, padded queries]``, as triton.py's
    ``_store_ds_buffer``) of the GDPA backward for bf16 silu / fast_gelu; arguments as
    :func:`forward`, ``dk_scale`` and ``dv_scale`` as triton.py's backward launcher."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    # key tiles: the forward's work list with the roles of queries and keys swapped
    work, total = work_list(kv_offsets, q_offsets, batch_order, num_heads, max_kv_len, wrap)
    element = gl.bfloat16
    kv_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], element)
    ds_layout = gl.NVMMASharedLayout.get_default_for([64, block_m], element)

    def descriptor(t, block_rows, layout):
        return TensorDescriptor(t, [t.shape[0], num_heads * head_dim], [t.stride(0), 1],
                                [block_rows, head_dim], layout)

    ds_rows = ds.view(-1, ds.shape[2])
    ds_desc = TensorDescriptor(ds_rows, list(ds_rows.shape), [ds_rows.stride(0), 1], [64, block_m],
                               ds_layout)
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device() if q.device.index is None else q.device.index)
    wrap(_gdpa_dkdv_kernel)[(max(1, min(work.shape[0], num_sms)),)](
        descriptor(k, 64, kv_layout), descriptor(v, 64, kv_layout), descriptor(q, block_m, q_layout),
        descriptor(grad_out, block_m, q_layout), descriptor(dk, 64, kv_layout),
        descriptor(dv, 64, kv_layout), ds_desc, dk, dv, ds, work, total, dk.stride(0),
        dv.stride(0), ds.stride(1), k.shape[0], scale, dk_scale, dv_scale,
        ACTIVATION=activation_code, HEAD_D=head_dim, BLOCK_M=block_m, STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
