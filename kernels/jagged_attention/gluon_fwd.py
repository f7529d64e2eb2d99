"""Hopper (sm_90) attention forward in Gluon, persistent and warp-specialized: GDPA's
(``_gdpa_fwd_kernel``) and softmax's (``_softmax_fwd_kernel``, issue #71).

GDPA's is on by default (``settings.gluon``; ``kernels.gluon=false`` or ``GEM_KERNELS_GLUON=0``
turns it off; imported at the first GDPA forward): ``launch.py`` takes this kernel instead of the
Triton forward where ``gluon_common.applies`` holds and ``max_q_len`` exceeds
``settings.gluon_min_q_len`` (128; there the Triton forward measured faster). Same math as the
Triton forward (``gdpa_act`` / ``gdpa_act_packed``, the output scale folded by the launcher), so
the two agree to rounding. Softmax's takes the same calls without a mask, but only on a Triton
release in ``call.GLUON_VERIFIED["gluon_softmax_fwd"]``: none yet (built without a GPU), so it
runs only under ``testing.unverified_gluon()`` (the kernel tests, ``benchmarks/attention.py``).

Structure (FlashAttention-3's forward):

* One program per SM loops over a compact list of work tiles (128 query rows of one example
  and head), built on the GPU by :func:`_work_list_kernel` without a host sync: examples in
  ``batch_order`` (most work first), then query blocks, then heads. Programs stride through the
  list, so every SM gets a mix of long and short tiles.
* Per program, one loader warp issues TMA copies (Q tiles double-buffered, K/V through a ring
  of ``STAGES`` slots) from host-built tensor descriptors over ``[rows, H * D]``, while two
  4-warp consumers each own 64 of the tile's 128 query rows and share the K/V ring. A consumer
  issues ``S_j = Q K_j^T`` and ``P_{j-1} V_{j-1}`` back to back, so the tensor cores run one
  while its warps compute the activation of the other (softmax: the online softmax of ``S_j``,
  after which the accumulator is rescaled to the new row maxima). The pipeline runs on across
  tiles: a tile's last ``P V`` goes out with the next tile's first ``Q K^T``, and its output
  (softmax: divided by the row sums, with their log-sum-exp) is stored after it.
* A descriptor's rows run on into the next example: the last key tile of an example is masked
  in registers (columns past its end give ``P = 0``), and a consumer's 64 output rows go through
  shared memory, by TMA where all are the example's and by masked 16-byte stores else. Rows
  past the tensor's end are zero-filled by the TMA unit.

GDPA's is faster than the Triton forward above 128 rows (``benchmarks/attention.py --lengths``;
the figures in docs/log/kernels.md); tested on the GPU by ``test_gpu_gluon_forward*`` and
``test_gpu_gluon_softmax_forward``.
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
    SOFTMAX,
    addressable,
    barriers,
    sm_count,
    store_tile,
    work_list,
    work_tile,
)
from kernels.jagged_attention.triton_common import FAST_GELU_BF16X2, LOG2E, SILU_BF16X2

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
def _softmax_probabilities(s, m_i, l_i, j, kv_len, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr):
    """Online softmax over key tile j, in the log2 domain as the Triton forward's: (P, the new row
    maxima and sums, alpha). P (the A operand of P V) is taken against the new maxima, and alpha
    rescales the accumulator's earlier tiles to them. The example's last tile gives the columns
    past its end P = 0. Every tile holds at least one of the example's keys, so the maxima are
    finite after the first (``m_i`` starts at -inf, which makes that tile's alpha 0)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    s = s * qk_scale
    if (j + 1) * BLOCK_N > kv_len:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(
            (cols < kv_len - j * BLOCK_N)[None, :], s, gl.full(s.shape, float("-inf"), gl.float32, s.type.layout)
        )
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), m_new, l_new, alpha


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
def _epilogue(
    acc,
    m_i,
    l_i,
    O,
    LSE,
    o_desc,
    o_buf,
    row0,
    num_rows,
    h,
    stride_ot,
    stride_oh,
    stride_lse_h,
    out_scale,
    SOFTMAX_MODE: gl.constexpr,
    dtype: gl.constexpr,
):
    """Stores a consumer's 64 output rows (those below ``num_rows``), see :func:`store_tile`. For
    softmax, the rows divided by their sums ``l_i`` and, as the Triton forward, their log-sum-exp
    ``m_i + log2(l_i)`` into ``LSE [H, rows]`` (+inf for a row that saw no key, whose output is 0)."""
    if SOFTMAX_MODE:
        seen = l_i > 0.0
        sums = gl.where(seen, l_i, gl.full(l_i.shape, 1.0, gl.float32, l_i.type.layout))
        out = acc / gl.convert_layout(sums, gl.SliceLayout(1, acc.type.layout))[:, None]
        lse = gl.where(seen, m_i + gl.log2(sums), gl.full(l_i.shape, float("inf"), gl.float32, l_i.type.layout))
        rows = gl.arange(0, l_i.shape[0], layout=l_i.type.layout)
        gl.store(LSE + h * stride_lse_h + row0 + rows, lse, mask=rows < num_rows)
    else:
        out = acc * out_scale
    store_tile(out.to(dtype), O + h * stride_oh, o_desc, o_buf, row0, h * acc.shape[1], num_rows, stride_ot)


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
    LSE,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    stride_lse_h,
    WORK,
    TOTAL,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
    HALF: gl.constexpr,
    SOFTMAX_MODE: gl.constexpr,
):
    """A 4-warp consumer: rows ``HALF * 64`` to ``HALF * 64 + 63`` of each of the program's work
    tiles. It reads the next tile's entry while it computes the current one.

    The software pipeline runs across tiles: a tile's last ``P V`` is issued after the next
    tile's first ``Q K^T`` (the tensor cores run it while the warps compute that tile's first
    activation), and its output is stored then. ``pending`` (0 or 1) says whether such a
    product is waiting; when none is, the step multiplies ``P = 0`` and stores nothing.

    Softmax (``scale`` in log2 units) keeps each row's running maximum ``m_i`` and sum ``l_i``
    (FlashAttention's online softmax): tile j's P is computed while ``P_{j-1} V_{j-1}`` runs,
    then the accumulator is rescaled to the new maxima before ``P_j V_j`` joins it. The pending
    tile's maxima and sums (``out_m``, ``out_l``) go to its epilogue."""
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
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    p_zero = gl.zeros([64, BLOCK_N], dtype, p_layout)
    m_start = gl.full([64], float("-inf"), gl.float32, row_layout)
    l_zero = gl.zeros([64], gl.float32, row_layout)
    total = gl.load(TOTAL)
    step = gl.num_programs(0)
    o_buf = o_smem.index(HALF)
    it = 0
    done = 0
    # the tile whose last P V is pending: its P, K/V slot, output rows, head (and softmax statistics)
    acc = o_zero
    p = p_zero
    pending = 0
    prev = 0
    out_row0 = 0
    out_rows = 0
    out_h = 0
    out_m = m_start
    out_l = l_zero
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
            if SOFTMAX_MODE:
                p_next, m_i, l_i, _alpha = _softmax_probabilities(s, m_start, l_zero, 0, kv_len, scale, p_layout, dtype)
            else:
                p_next = _probabilities(s, 0, kv_len, scale, p_layout, ACTIVATION, PACKED, dtype)
                m_i = m_start
                l_i = l_zero
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
            _epilogue(
                acc,
                out_m,
                out_l,
                O,
                LSE,
                o_desc,
                o_buf,
                out_row0,
                out_rows * pending,
                out_h,
                stride_ot,
                stride_oh,
                stride_lse_h,
                out_scale,
                SOFTMAX_MODE,
                dtype,
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
                if SOFTMAX_MODE:
                    p_next, m_i, l_i, alpha = _softmax_probabilities(s, m_i, l_i, j, kv_len, scale, p_layout, dtype)
                else:
                    p_next = _probabilities(s, j, kv_len, scale, p_layout, ACTIVATION, PACKED, dtype)
                acc, p = warpgroup_mma_wait(0, deps=(acc, p))
                mbarrier.arrive(kv_free.index(prev), count=1)
                if SOFTMAX_MODE:
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p = p_next
            mbarrier.arrive(q_free.index(qb), count=1)
            prev = (it + n_tiles - 1) % STAGES
            it += n_tiles
            pending = 1
            out_row0 = row0
            out_rows = num_rows
            out_h = h
            out_m = m_i
            out_l = l_i
        else:  # no keys: flush the pending product, then store zeros
            mbarrier.arrive(q_free.index(qb), count=1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
            _epilogue(
                acc,
                out_m,
                out_l,
                O,
                LSE,
                o_desc,
                o_buf,
                out_row0,
                out_rows * pending,
                out_h,
                stride_ot,
                stride_oh,
                stride_lse_h,
                out_scale,
                SOFTMAX_MODE,
                dtype,
            )
            _epilogue(
                o_zero,
                m_start,
                l_zero,
                O,
                LSE,
                o_desc,
                o_buf,
                row0,
                num_rows,
                h,
                stride_ot,
                stride_oh,
                stride_lse_h,
                out_scale,
                SOFTMAX_MODE,
                dtype,
            )
            acc = o_zero
            p = p_zero
            pending = 0
        done += 1
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(kv_free.index(prev), count=1, pred=pending != 0)
    _epilogue(
        acc,
        out_m,
        out_l,
        O,
        LSE,
        o_desc,
        o_buf,
        out_row0,
        out_rows * pending,
        out_h,
        stride_ot,
        stride_oh,
        stride_lse_h,
        out_scale,
        SOFTMAX_MODE,
        dtype,
    )
    tma.store_wait(0)


# warp_specialize passes its partitions runtime values only (a constexpr among them arrives as a
# value), so each half of each kind gets its own entry, which passes its constexprs itself.
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
        O,  # (no LSE)
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        0,
        WORK,
        TOTAL,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
        0,
        False,
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
        O,  # (no LSE)
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        0,
        WORK,
        TOTAL,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
        1,
        False,
    )


@gluon.jit
def _softmax_consumer0(
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_free,
    kv_ready,
    kv_free,
    O,
    LSE,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    stride_lse_h,
    WORK,
    TOTAL,
    qk_scale,
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
        LSE,
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        stride_lse_h,
        WORK,
        TOTAL,
        qk_scale,
        1.0,
        SOFTMAX,
        False,
        0,
        True,
    )


@gluon.jit
def _softmax_consumer1(
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_free,
    kv_ready,
    kv_free,
    O,
    LSE,
    o_desc,
    o_smem,
    stride_ot,
    stride_oh,
    stride_lse_h,
    WORK,
    TOTAL,
    qk_scale,
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
        LSE,
        o_desc,
        o_smem,
        stride_ot,
        stride_oh,
        stride_lse_h,
        WORK,
        TOTAL,
        qk_scale,
        1.0,
        SOFTMAX,
        False,
        1,
        True,
    )


@gluon.jit
def _forward_body(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    O,
    LSE,
    WORK,
    TOTAL,
    stride_ot,
    stride_oh,
    stride_lse_h,
    scale,
    out_scale,
    ACTIVATION: gl.constexpr,
    PACKED: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    Q_BUFFERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    SOFTMAX_MODE: gl.constexpr,
):
    """Both kernels' body: shared memory, barriers, the loader warp and the two consumers."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_D], o_desc.layout)  # one per consumer
    q_ready = barriers(Q_BUFFERS, 1)
    q_free = barriers(Q_BUFFERS, 2)
    kv_ready = barriers(STAGES, 1)
    kv_free = barriers(STAGES, 2)
    loader_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free, WORK, TOTAL)
    ring = (q_smem, k_smem, v_smem, q_ready, q_free, kv_ready, kv_free)
    if SOFTMAX_MODE:
        args = ring + (O, LSE, o_desc, o_smem, stride_ot, stride_oh, stride_lse_h, WORK, TOTAL, scale)
        gl.warp_specialize(
            [(_softmax_consumer0, args), (_softmax_consumer1, args), (_loader, loader_args)],
            [4, 1],
            [CONSUMER_REGS, 24],
        )
    else:
        args = ring + (O, o_desc, o_smem, stride_ot, stride_oh, WORK, TOTAL, scale, out_scale, ACTIVATION, PACKED)
        gl.warp_specialize(
            [(_consumer0, args), (_consumer1, args), (_loader, loader_args)], [4, 1], [CONSUMER_REGS, 24]
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
    """GDPA, a pointwise activation: O scaled by ``out_scale``."""
    _forward_body(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        O,
        O,  # (no LSE)
        WORK,
        TOTAL,
        stride_ot,
        stride_oh,
        0,
        scale,
        out_scale,
        ACTIVATION,
        PACKED,
        HEAD_D,
        BLOCK_N,
        STAGES,
        Q_BUFFERS,
        CONSUMER_REGS,
        False,
    )


@gluon.jit
def _softmax_fwd_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    O,
    LSE,
    WORK,
    TOTAL,
    stride_ot,
    stride_oh,
    stride_lse_h,
    qk_scale,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    Q_BUFFERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Softmax (``qk_scale`` in log2 units): O and its rows' log-sum-exp in ``LSE``."""
    _forward_body(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        O,
        LSE,
        WORK,
        TOTAL,
        stride_ot,
        stride_oh,
        stride_lse_h,
        qk_scale,
        1.0,
        SOFTMAX,
        False,
        HEAD_D,
        BLOCK_N,
        STAGES,
        Q_BUFFERS,
        CONSUMER_REGS,
        True,
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
    lse=None,
) -> None:
    """Writes the forward of ``[rows, H, D]`` q, k, v into ``out`` (see :func:`applies`), which
    must be shaped as q, with the layout :func:`applies` asks of q (the output's TMA stores
    address it as ``[rows, H * D]``).

    GDPA: ``out_scale`` is the launcher's ``post_scale * ACT_UNIT * scale``. Softmax
    (``activation_code`` 0; ``out_scale`` and ``packed`` unused): ``lse`` ``[H, rows]`` float32
    receives each row's log-sum-exp in log2 units, as ``triton_fwd.forward``'s. ``num_sms``
    (the grid size; default, the GPU's SM count) and ``wrap`` (see ``triton_fwd.forward``) let
    tests compile without launching."""
    if out.shape != q.shape or not addressable(out):
        raise ValueError(
            f"gluon.forward: out must have q's shape {tuple(q.shape)}, adjacent heads "
            f"and 16-byte aligned rows; got shape {tuple(out.shape)}, strides "
            f"{out.stride()}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    softmax = activation_code == SOFTMAX.value
    if softmax and (lse is None or lse.shape != (num_heads, q.shape[0]) or lse.dtype != torch.float32):
        raise ValueError(f"gluon.forward: softmax needs lse, float32 [H, rows] = {[num_heads, q.shape[0]]}")
    work, total = work_list(q_offsets, kv_offsets, batch_order, num_heads, max_q_len, wrap)

    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], element)

    def descriptor(t, block_rows, layout):
        return TensorDescriptor(t, [t.shape[0], num_heads * head_dim], [t.stride(0), 1], [block_rows, head_dim], layout)

    if num_sms is None:
        num_sms = sm_count(torch.cuda.current_device() if q.device.index is None else q.device.index)
    descriptors = (
        descriptor(q, 64, q_layout),
        descriptor(k, BLOCK_N, kv_layout),
        descriptor(v, BLOCK_N, kv_layout),
        descriptor(out, 64, q_layout),
    )
    grid = (max(1, min(work.shape[0], num_sms)),)
    tiles = dict(
        HEAD_D=head_dim, BLOCK_N=BLOCK_N, STAGES=STAGES, Q_BUFFERS=Q_BUFFERS, CONSUMER_REGS=CONSUMER_REGS, num_warps=4
    )
    if softmax:
        wrap(_softmax_fwd_kernel)[grid](
            *descriptors, out, lse, work, total, out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E, **tiles
        )
        return
    wrap(_gdpa_fwd_kernel)[grid](
        *descriptors,
        out,
        work,
        total,
        out.stride(0),
        out.stride(1),
        scale,
        out_scale,
        ACTIVATION=activation_code,
        PACKED=packed,
        **tiles,
    )
