"""Hopper (sm_90) GDPA forward in Gluon: persistent and warp-specialized.

On by default (``settings.gluon``; ``kernels.gluon=false`` or ``GEM_KERNELS_GLUON=0`` turns it off;
imported at the first GDPA forward): ``launch.py`` takes this kernel instead of the Triton forward where
``gluon_common.applies`` holds and ``max_q_len`` exceeds ``settings.gluon_min_q_len`` (128; there
the Triton forward measured faster). Same math as the Triton forward (``gdpa_act`` /
``gdpa_act_packed``, the output scale folded by the launcher), so the two agree to rounding.

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

Faster than the Triton forward above 128 rows (``benchmarks/attention.py --lengths``; the
figures in docs/log/kernels.md); tested on the GPU by ``test_gpu_gluon_forward*``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.jagged_attention.gluon_common import (
    CONSUMER_REGS,
    FAST_GELU,
    GELU,
    RELU,
    SILU,
    addressable,
    barriers,
    sm_count,
    store_tile,
    work_list,
    work_tile,
)
from kernels.jagged_attention.triton_common import FAST_GELU_BF16X2, SILU_BF16X2

BLOCK_N = 64
STAGES = 4  # K/V ring slots
Q_BUFFERS = 2  # Q tiles in flight: the next tile's loads overlap the current one's epilogue


@gluon.jit
def _tanh(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _activation(s, scale, ACTIVATION: gl.constexpr, PACKED: gl.constexpr, dtype: gl.constexpr):
    """P of the float32 scores s, in ``dtype``: triton_common's ``gdpa_act`` (FAST) or, where
    PACKED (bf16 silu / fast_gelu), ``gdpa_act_packed``."""
    if PACKED:
        x = s.to(dtype)
        if ACTIVATION == SILU:
            h = gl.full(x.shape, 0.5 * scale, dtype, x.type.layout)
            return gl.inline_asm_elementwise(SILU_BF16X2, "=r,r,r", [x, h], dtype=x.dtype, is_pure=True, pack=2)
        a = scale * 0.7978845608028654
        a2 = gl.full(x.shape, a, dtype, x.type.layout)
        b2 = gl.full(x.shape, a * 0.044715 * scale * scale, dtype, x.type.layout)
        return gl.inline_asm_elementwise(FAST_GELU_BF16X2, "=r,r,r,r", [x, a2, b2], dtype=x.dtype, is_pure=True, pack=2)
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
def _probabilities(
    s, j, kv_len, scale, p_layout: gl.constexpr, ACTIVATION: gl.constexpr, PACKED: gl.constexpr, dtype: gl.constexpr
):
    """P of key tile j as the A operand of P V; the example's last tile zeroes the columns past
    its end (they hold the next example's keys)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    p = _activation(s, scale, ACTIVATION, PACKED, dtype)
    if (j + 1) * BLOCK_N > kv_len:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        p = gl.where((cols < kv_len - j * BLOCK_N)[None, :], p, gl.zeros_like(p))
    return gl.convert_layout(p, p_layout)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, WORK, TOTAL):
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
        row0, num_rows, h, kv_start, kv_len = work_tile(WORK, t, True)
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
            tma.async_copy_global_to_shared(k_desc, [kv_start + j * BLOCK_N, h * HEAD_D], bar, k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [kv_start + j * BLOCK_N, h * HEAD_D], bar, v_smem.index(slot))
            it += 1
        done += 1


@gluon.jit
def _epilogue(acc, O, o_desc, o_buf, row0, num_rows, h, stride_ot, stride_oh, out_scale, dtype: gl.constexpr):
    """Stores a consumer's 64 output rows (those below ``num_rows``), see :func:`store_tile`."""
    store_tile(
        (acc * out_scale).to(dtype), O + h * stride_oh, o_desc, o_buf, row0, h * acc.shape[1], num_rows, stride_ot
    )


@gluon.jit
def _consumer(
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_free,
    kv_ready,
    kv_free,
    O,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    WORK,
    TOTAL,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
    HALF: gl.constexpr,
):
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
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
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
    next_row0, next_rows, next_h, _, next_kv_len = work_tile(WORK, gl.program_id(0), gl.program_id(0) < total)
    for t in range(gl.program_id(0), total, step):
        row0 = next_row0 + HALF * 64
        num_rows = next_rows - HALF * 64
        h = next_h
        kv_len = next_kv_len
        next_row0, next_rows, next_h, _, next_kv_len = work_tile(WORK, t + step, t + step < total)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        qb = done % Q_BUFFERS
        q = q_smem.index(2 * qb + HALF)
        mbarrier.wait(q_ready.index(qb), phase=(done // Q_BUFFERS) & 1)
        if n_tiles > 0:
            slot = it % STAGES
            if pending == 0:
                prev = slot  # a ready slot for the P = 0 product
            mbarrier.wait(kv_ready.index(slot), phase=(it // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            p_next = _probabilities(s, 0, kv_len, scale, p_layout, ACTIVATION, PACKED, dtype)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
            _epilogue(
                acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot, stride_oh, out_scale, dtype
            )
            acc = o_zero
            p = p_next
            for j in range(1, n_tiles):
                c = it + j
                slot = c % STAGES
                prev = (c - 1) % STAGES
                mbarrier.wait(kv_ready.index(slot), phase=(c // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
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
            _epilogue(
                acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot, stride_oh, out_scale, dtype
            )
            _epilogue(o_zero, O, o_desc, o_buf, row0, num_rows, h, stride_ot, stride_oh, out_scale, dtype)
            acc = o_zero
            p = p_zero
            pending = 0
        done += 1
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
    _epilogue(acc, O, o_desc, o_buf, out_row0, out_rows * pending, out_h, stride_ot, stride_oh, out_scale, dtype)
    tma.store_wait(0)


# warp_specialize passes its partitions runtime values only, so each half gets its own entry.
@gluon.jit
def _consumer0(
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_free,
    kv_ready,
    kv_free,
    O,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    WORK,
    TOTAL,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
):
    _consumer(
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_free,
        kv_ready,
        kv_free,
        O,
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        WORK,
        TOTAL,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
        0,
    )


@gluon.jit
def _consumer1(
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_free,
    kv_ready,
    kv_free,
    O,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    WORK,
    TOTAL,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
):
    _consumer(
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_free,
        kv_ready,
        kv_free,
        O,
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        WORK,
        TOTAL,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
        1,
    )


@gluon.jit
def _gdpa_fwd_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    O,
    WORK,
    TOTAL,
    stride_ot,
    stride_oh,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    Q_BUFFERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_D], o_desc.layout)  # one per consumer
    q_ready = barriers(Q_BUFFERS, 1)
    q_free = barriers(Q_BUFFERS, 2)
    kv_ready = barriers(STAGES, 1)
    kv_free = barriers(STAGES, 2)
    consumer_args = (
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_free,
        kv_ready,
        kv_free,
        O,
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        WORK,
        TOTAL,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
    )
    gl.warp_specialize(
        [
            (_consumer0, consumer_args),
            (_consumer1, consumer_args),
            (
                _loader,
                (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, WORK, TOTAL),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )


def forward(
    q,
    k,
    v,
    out,
    q_offsets,
    kv_offsets,
    batch_order,
    max_q_len,
    activation_code,
    scale,
    out_scale,
    packed,
    wrap=lambda kernel: kernel,
    num_sms=None,
) -> None:
    """Writes the GDPA forward of ``[rows, H, D]`` q, k, v into ``out`` (see :func:`applies`),
    which must be shaped as q, with the layout :func:`applies` asks of q (the output's TMA stores
    address it as ``[rows, H * D]``).

    ``out_scale`` is the launcher's ``post_scale * ACT_UNIT * scale``; ``num_sms`` (the grid
    size; default, the GPU's SM count) and ``wrap`` (see ``triton_fwd.forward``) let tests compile
    without launching."""
    if out.shape != q.shape or not addressable(out):
        raise ValueError(
            f"gluon.forward: out must have q's shape {tuple(q.shape)}, adjacent heads "
            f"and 16-byte aligned rows; got shape {tuple(out.shape)}, strides "
            f"{out.stride()}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    work, total = work_list(q_offsets, kv_offsets, batch_order, num_heads, max_q_len, wrap)

    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], element)

    def descriptor(t, block_rows, layout):
        return TensorDescriptor(t, [t.shape[0], num_heads * head_dim], [t.stride(0), 1], [block_rows, head_dim], layout)

    if num_sms is None:
        num_sms = sm_count(torch.cuda.current_device() if q.device.index is None else q.device.index)
    wrap(_gdpa_fwd_kernel)[(max(1, min(work.shape[0], num_sms)),)](
        descriptor(q, 64, q_layout),
        descriptor(k, BLOCK_N, kv_layout),
        descriptor(v, BLOCK_N, kv_layout),
        descriptor(out, 64, q_layout),
        out,
        work,
        total,
        out.stride(0),
        out.stride(1),
        scale,
        out_scale,
        ACTIVATION=activation_code,
        PACKED=packed,
        HEAD_D=head_dim,
        BLOCK_N=BLOCK_N,
        STAGES=STAGES,
        Q_BUFFERS=Q_BUFFERS,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )
