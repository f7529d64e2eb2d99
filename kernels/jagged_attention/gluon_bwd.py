"""Hopper (sm_90) GDPA backward's dK/dV (and the stored dS) in Gluon: persistent, warp-specialized.

On by default (``settings.gluon_bwd``; kernels.gluon_bwd=false turns it off; ``call.py`` says when
it runs): the stored-dS backward's dK/dV kernel for bf16 silu and fast_gelu (the bf16x2
activation path) where ``gluon_common.applies`` holds (its softmax variant, ``gluon_bwd_softmax``,
was deleted: no faster end to end, docs/log/kernels.md). The forward's structure with the roles
of queries and keys swapped: a work tile is 128 keys of one example and head (the forward's work list built over
the keys), two 4-warp consumers of 64 keys each, a loader warp that loads a tile's K and V
into one of two buffers (the next tile's load overlaps this one's steps) and streams Q and dO
tiles of BWD_BLOCK_M rows through a ring. dK and dV leave through the K and V buffers they
replace, dS through a small buffer per consumer, by TMA where a consumer's 64 keys are all
the example's. Same math, order of products and tile sizes as the Triton dK/dV kernel's
autotuned choice at the short rows (32 queries per step): on an H200 the gradients came out
identical to it. The Triton dQ kernel then reads dS.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.jagged_attention import triton_common as tc
from kernels.jagged_attention.gluon_common import (
    CONSUMER_REGS,
    SILU,
    barriers,
    sm_count,
    store_tile,
    work_list,
    work_tile,
)

BWD_BLOCK_M = 32  # query rows per step
BWD_STAGES = 4  # Q/dO ring slots


@gluon.jit
def _grads(st, dpt, j, q_len, scale, ACTIVATION: gl.constexpr):
    """(P^T, dS^T) of step j from the float32 ``S^T`` and ``dP^T`` tiles ([keys, queries]), in
    bf16: triton_common's ``gdpa_act_and_grad_packed``. Query columns past the example's end (the
    next example's rows) give zeros."""
    BLOCK_M: gl.constexpr = st.shape[1]
    layout: gl.constexpr = st.type.layout
    x = st.to(gl.bfloat16)
    dp = dpt.to(gl.bfloat16)
    if ACTIVATION == SILU:
        h = gl.full(x.shape, 0.5 * scale, gl.bfloat16, layout)
        p, ds = gl.inline_asm_elementwise(
            tc.SILU_GRAD_BF16X2, "=r,=r,r,r,r", [x, dp, h], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=2
        )
    else:
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        a2 = gl.full(x.shape, a, gl.bfloat16, layout)
        b2 = gl.full(x.shape, b, gl.bfloat16, layout)
        b3 = gl.full(x.shape, 3.0 * b, gl.bfloat16, layout)
        p, ds = gl.inline_asm_elementwise(
            tc.FAST_GELU_GRAD_BF16X2,
            "=r,=r,r,r,r,r,r",
            [x, dp, a2, b2, b3],
            dtype=(gl.bfloat16, gl.bfloat16),
            is_pure=True,
            pack=2,
        )
    if (j + 1) * BLOCK_M > q_len:
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        keep = (cols < q_len - j * BLOCK_M)[None, :]
        p = gl.where(keep, p, gl.zeros_like(p))
        ds = gl.where(keep, ds, gl.zeros_like(ds))
    return p, ds


@gluon.jit
def _dkdv_loader(
    k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_free, ready, free, WORK, TOTAL
):
    """The backward's loader warp: for each of the program's tiles, its K and V halves into one
    of two buffers (once both consumers released it), then its Q and dO tiles into the ring."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    total = gl.load(TOTAL)
    it = 0  # Q/dO tiles loaded so far
    done = 0  # work tiles loaded so far
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        row0, num_keys, h, q_start, q_len = work_tile(WORK, t, True)
        b = done % 2
        mbarrier.wait(kv_free.index(b), phase=((done // 2) + 1) & 1, pred=done >= 2)
        bar = kv_ready.index(b)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [row0 + half * 64, h * HEAD_D], bar, k_smem.index(2 * b + half))
            tma.async_copy_global_to_shared(v_desc, [row0 + half * 64, h * HEAD_D], bar, v_smem.index(2 * b + half))
        for j in range(gl.cdiv(q_len, BLOCK_M)):
            slot = it % STAGES
            mbarrier.wait(free.index(slot), phase=((it // STAGES) + 1) & 1, pred=it >= STAGES)
            bar = ready.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + j * BLOCK_M, h * HEAD_D], bar, q_smem.index(slot))
            tma.async_copy_global_to_shared(do_desc, [q_start + j * BLOCK_M, h * HEAD_D], bar, do_smem.index(slot))
            it += 1
        done += 1


@gluon.jit
def _dkdv_consumer(
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    ds_smem,
    kv_ready,
    kv_free,
    ready,
    free,
    DK,
    DV,
    DS,
    dk_desc,
    dv_desc,
    ds_desc,
    stride_dkt,
    stride_dvt,
    stride_dst,
    kv_rows,
    WORK,
    TOTAL,
    scale,
    dk_scale,
    dv_scale,
    ACTIVATION: gl.constexpr,
    HALF: gl.constexpr,
):
    """A 4-warp consumer: keys ``HALF * 64`` to ``HALF * 64 + 63`` of each of the program's work
    tiles. Per step it issues ``S^T = K Q^T`` and ``dP^T = V dO^T``, then the previous step's
    ``dV += P^T dO`` and ``dK += dS^T Q``, and computes this step's P and dS (and stores dS)
    while those two run. dK and dV go out through the tile's K and V buffers."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    o_zero = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    ds_buf = ds_smem.index(HALF)
    total = gl.load(TOTAL)
    step = gl.num_programs(0)
    it = 0
    done = 0
    next_row0, next_keys, next_h, _, next_q_len = work_tile(WORK, gl.program_id(0), gl.program_id(0) < total)
    for t in range(gl.program_id(0), total, step):
        row0 = next_row0 + HALF * 64
        num_keys = next_keys - HALF * 64
        h = next_h
        q_len = next_q_len
        next_row0, next_keys, next_h, _, next_q_len = work_tile(WORK, t + step, t + step < total)
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
            st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
            p, ds = _grads(st, dpt, 0, q_len, scale, ACTIVATION)
            store_tile(ds, DS, ds_desc, ds_buf, ds_row0, 0, num_keys, stride_dst)
            p = gl.convert_layout(p, a_layout)
            ds = gl.convert_layout(ds, a_layout)
            for j in range(1, n_steps):
                c = it + j
                slot = c % STAGES
                prev = (c - 1) % STAGES
                mbarrier.wait(ready.index(slot), phase=(c // STAGES) & 1)
                st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dv = warpgroup_mma(p, do_smem.index(prev), dv, is_async=True)
                dk = warpgroup_mma(ds, q_smem.index(prev), dk, is_async=True)
                st, dpt = warpgroup_mma_wait(2, deps=(st, dpt))
                p_next, ds_next = _grads(st, dpt, j, q_len, scale, ACTIVATION)
                dv, dk, p, ds = warpgroup_mma_wait(0, deps=(dv, dk, p, ds))
                mbarrier.arrive(free.index(prev), count=1)
                store_tile(ds_next, DS + j * BLOCK_M, ds_desc, ds_buf, ds_row0, j * BLOCK_M, num_keys, stride_dst)
                p = gl.convert_layout(p_next, a_layout)
                ds = gl.convert_layout(ds_next, a_layout)
            last = (it + n_steps - 1) % STAGES
            dv = warpgroup_mma(p, do_smem.index(last), dv, is_async=True)
            dk = warpgroup_mma(ds, q_smem.index(last), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(free.index(last), count=1)
            it += n_steps
        # every product that read this tile's K and V is complete: they take dK and dV
        store_tile((dk * dk_scale).to(dtype), DK + h * HEAD_D, dk_desc, k, row0, h * HEAD_D, num_keys, stride_dkt)
        store_tile((dv * dv_scale).to(dtype), DV + h * HEAD_D, dv_desc, v, row0, h * HEAD_D, num_keys, stride_dvt)
        tma.store_wait(0)
        mbarrier.arrive(kv_free.index(b), count=1)
        done += 1


@gluon.jit
def _dkdv_consumer0(
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    ds_smem,
    kv_ready,
    kv_free,
    ready,
    free,
    DK,
    DV,
    DS,
    dk_desc,
    dv_desc,
    ds_desc,
    stride_dkt,
    stride_dvt,
    stride_dst,
    kv_rows,
    WORK,
    TOTAL,
    scale,
    dk_scale,
    dv_scale,
    ACTIVATION: gl.constexpr,
):
    _dkdv_consumer(
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        ds_smem,
        kv_ready,
        kv_free,
        ready,
        free,
        DK,
        DV,
        DS,
        dk_desc,
        dv_desc,
        ds_desc,
        stride_dkt,
        stride_dvt,
        stride_dst,
        kv_rows,
        WORK,
        TOTAL,
        scale,
        dk_scale,
        dv_scale,
        ACTIVATION,
        0,
    )


@gluon.jit
def _dkdv_consumer1(
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    ds_smem,
    kv_ready,
    kv_free,
    ready,
    free,
    DK,
    DV,
    DS,
    dk_desc,
    dv_desc,
    ds_desc,
    stride_dkt,
    stride_dvt,
    stride_dst,
    kv_rows,
    WORK,
    TOTAL,
    scale,
    dk_scale,
    dv_scale,
    ACTIVATION: gl.constexpr,
):
    _dkdv_consumer(
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        ds_smem,
        kv_ready,
        kv_free,
        ready,
        free,
        DK,
        DV,
        DS,
        dk_desc,
        dv_desc,
        ds_desc,
        stride_dkt,
        stride_dvt,
        stride_dst,
        kv_rows,
        WORK,
        TOTAL,
        scale,
        dk_scale,
        dv_scale,
        ACTIVATION,
        1,
    )


@gluon.jit
def _gdpa_dkdv_kernel(
    k_desc,
    v_desc,
    q_desc,
    do_desc,
    dk_desc,
    dv_desc,
    ds_desc,
    DK,
    DV,
    DS,
    WORK,
    TOTAL,
    stride_dkt,
    stride_dvt,
    stride_dst,
    kv_rows,
    scale,
    dk_scale,
    dv_scale,
    ACTIVATION: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [4, 64, HEAD_D], k_desc.layout)  # 2 tiles x halves
    v_smem = gl.allocate_shared_memory(dtype, [4, 64, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_M], ds_desc.layout)  # per consumer
    kv_ready = barriers(2, 1)
    kv_free = barriers(2, 2)
    ready = barriers(STAGES, 1)
    free = barriers(STAGES, 2)
    consumer_args = (
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        ds_smem,
        kv_ready,
        kv_free,
        ready,
        free,
        DK,
        DV,
        DS,
        dk_desc,
        dv_desc,
        ds_desc,
        stride_dkt,
        stride_dvt,
        stride_dst,
        kv_rows,
        WORK,
        TOTAL,
        scale,
        dk_scale,
        dv_scale,
        ACTIVATION,
    )
    gl.warp_specialize(
        [
            (_dkdv_consumer0, consumer_args),
            (_dkdv_consumer1, consumer_args),
            (
                _dkdv_loader,
                (
                    k_desc,
                    v_desc,
                    q_desc,
                    do_desc,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    kv_ready,
                    kv_free,
                    ready,
                    free,
                    WORK,
                    TOTAL,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )


def dkdv(
    q,
    k,
    v,
    grad_out,
    dk,
    dv,
    ds,
    q_offsets,
    kv_offsets,
    batch_order,
    max_kv_len,
    activation_code,
    scale,
    dk_scale,
    dv_scale,
    wrap=lambda kernel: kernel,
    num_sms=None,
    block_m=BWD_BLOCK_M,
    stages=BWD_STAGES,
) -> None:
    """Writes dK, dV and the stored dS (``ds``: ``[H, K/V rows, padded queries]``, as ``launch.py``'s
    stored-dS buffer) of the GDPA backward for bf16 silu / fast_gelu; arguments as
    :func:`forward`, ``dk_scale`` and ``dv_scale`` as the Triton dK/dV launcher's."""
    if activation_code not in (tc.ACTIVATION_CODES["silu"], tc.ACTIVATION_CODES["fast_gelu"]):
        names = {code: name for name, code in tc.ACTIVATION_CODES.items()}
        raise ValueError(
            f"gluon_bwd.dkdv: the Gluon dK/dV runs bf16 silu and fast_gelu only, not "
            f"{names.get(activation_code, activation_code)!r} (the Triton dK/dV takes the others)"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    # key tiles: the forward's work list with the roles of queries and keys swapped
    work, total = work_list(kv_offsets, q_offsets, batch_order, num_heads, max_kv_len, wrap)
    element = gl.bfloat16
    kv_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], element)
    ds_layout = gl.NVMMASharedLayout.get_default_for([64, block_m], element)

    def descriptor(t, block_rows, layout):
        return TensorDescriptor(t, [t.shape[0], num_heads * head_dim], [t.stride(0), 1], [block_rows, head_dim], layout)

    ds_rows = ds.view(-1, ds.shape[2])
    ds_desc = TensorDescriptor(ds_rows, list(ds_rows.shape), [ds_rows.stride(0), 1], [64, block_m], ds_layout)
    if num_sms is None:
        num_sms = sm_count(torch.cuda.current_device() if q.device.index is None else q.device.index)
    wrap(_gdpa_dkdv_kernel)[(max(1, min(work.shape[0], num_sms)),)](
        descriptor(k, 64, kv_layout),
        descriptor(v, 64, kv_layout),
        descriptor(q, block_m, q_layout),
        descriptor(grad_out, block_m, q_layout),
        descriptor(dk, 64, kv_layout),
        descriptor(dv, 64, kv_layout),
        ds_desc,
        dk,
        dv,
        ds,
        work,
        total,
        dk.stride(0),
        dv.stride(0),
        ds.stride(1),
        k.shape[0],
        scale,
        dk_scale,
        dv_scale,
        ACTIVATION=activation_code,
        HEAD_D=head_dim,
        BLOCK_M=block_m,
        STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )
