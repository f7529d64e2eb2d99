"""The personalized FFN's per-example weights ``W_0 + M G_b``, forward and backward in one Triton kernel each.

``generated_weights(shared [N, C], mix [N, S], generated [B, S, C]) -> [B, N, C]``: for every
example ``b``, ``shared + mix @ generated[b]``, computed in float32 and rounded once to
``generated``'s dtype. ``S`` (the summary tokens, a few) is the product's inner dimension, so the
output's write bounds the forward and the gradient's read bounds the backward.

Why kernels: at gem_base's shapes (B = 1,024, N = 256, C = 512, S = 4) the output is 268 MB a
call. Compiled as PyTorch, Inductor's fused broadcast sum wrote it at about half the H200's
bandwidth, and the backward read the gradient three times (a sum over the batch for ``shared``,
a batched GEMM for ``mix`` and a GEMM for ``generated``). Here the forward writes each output tile
once, with ``shared``'s tile held in registers across several examples, and the backward reads
each gradient tile once and makes all three gradients from it: ``shared``'s and ``mix``'s summed
over a group of examples in registers (a float32 partial per group, summed after), ``generated``'s
summed over a block of ``N`` (a partial per block).

``backend="reference"`` (the default off CUDA) is the same math in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jagged_attention.triton_common import OP_WRAP, define_op, fake_without_launch

BACKENDS = ("triton", "reference")
# forward: a [BLOCK_N, BLOCK_C] output tile per program, for FWD_SEQS examples in turn
FWD_BLOCK_N, FWD_BLOCK_C, FWD_SEQS = 64, 128, 8
# backward: a [BLOCK_N, BLOCK_C] gradient tile per program, for BWD_SEQS examples in turn
BWD_BLOCK_N, BWD_BLOCK_C, BWD_SEQS = 128, 64, 32


def generated_weights_reference(shared: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """:func:`generated_weights` in PyTorch: float32 math, rounded once to ``generated``'s dtype."""
    product = (mix.float().unsqueeze(-1) * generated.float().unsqueeze(1)).sum(2)  # [B, N, C]
    return (shared.float() + product).to(generated.dtype)


@triton.jit
def _generate_kernel(
    SHARED,
    MIX,
    GEN,
    OUT,
    num_seqs,
    N,
    C,
    stride_sh_n,
    stride_mix_n,
    stride_mix_s,
    stride_gen_b,
    stride_gen_s,
    stride_out_b,
    stride_out_n,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SEQS: tl.constexpr,
):
    """OUT[b, n, c] = SHARED[n, c] + sum_s MIX[n, s] GEN[b, s, c] for one (n, c) tile and SEQS examples."""
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_mask, c_mask = n < N, c < C
    tile_mask = n_mask[:, None] & c_mask[None, :]
    shared = tl.load(SHARED + n[:, None] * stride_sh_n + c[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    first = tl.program_id(2) * SEQS
    for i in range(SEQS):
        b = (first + i).to(tl.int64)
        valid = b < num_seqs
        product = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
        for s in tl.static_range(S):
            m = tl.load(MIX + n * stride_mix_n + s * stride_mix_s, mask=n_mask, other=0.0).to(tl.float32)
            g = tl.load(GEN + b * stride_gen_b + s * stride_gen_s + c, mask=c_mask & valid, other=0.0)
            product += m[:, None] * g.to(tl.float32)[None, :]
        out = OUT + b * stride_out_b + n[:, None] * stride_out_n + c[None, :]
        tl.store(out, (shared + product).to(OUT.dtype.element_ty), mask=tile_mask & valid)


@triton.jit
def _generate_bwd_kernel(
    GRAD,
    MIX,
    GEN,
    D_SHARED,
    D_MIX,
    D_GEN,
    num_seqs,
    N,
    C,
    stride_grad_b,
    stride_grad_n,
    stride_mix_n,
    stride_mix_s,
    stride_gen_b,
    stride_gen_s,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SEQS: tl.constexpr,
):
    """From one (n, c) tile of GRAD for SEQS examples: D_SHARED[group] = sum_b GRAD[b] and
    D_MIX[group, c block] = sum_b GRAD[b] GEN[b]^T over the tile, and, per example,
    D_GEN[n block, b] = MIX^T GRAD[b] over the tile's rows. All float32 partials, contiguous:
    D_SHARED [groups, N, C], D_MIX [groups, c blocks, N, S], D_GEN [n blocks, B, S, C]."""
    pid_c, pid_n, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s_ids = tl.arange(0, BLOCK_S)
    n_mask, c_mask = n < N, c < C
    tile_mask = n_mask[:, None] & c_mask[None, :]
    d_shared = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    d_mix = tl.zeros([BLOCK_N, BLOCK_S], tl.float32)
    first = group * SEQS
    for i in range(SEQS):
        b = (first + i).to(tl.int64)
        valid = b < num_seqs
        grad = tl.load(
            GRAD + b * stride_grad_b + n[:, None] * stride_grad_n + c[None, :], mask=tile_mask & valid, other=0.0
        ).to(tl.float32)
        d_shared += grad
        d_gen = D_GEN + (pid_n * num_seqs + b) * S * C + c
        for s in tl.static_range(S):
            g = tl.load(GEN + b * stride_gen_b + s * stride_gen_s + c, mask=c_mask & valid, other=0.0)
            d_mix += tl.where(s_ids[None, :] == s, tl.sum(grad * g.to(tl.float32)[None, :], axis=1)[:, None], 0.0)
            m = tl.load(MIX + n * stride_mix_n + s * stride_mix_s, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(d_gen + s * C, tl.sum(m[:, None] * grad, axis=0), mask=c_mask & valid)
    tl.store(D_SHARED + group.to(tl.int64) * N * C + n[:, None] * C + c[None, :], d_shared, mask=tile_mask)
    d_mix_rows = (group * tl.num_programs(0) + pid_c).to(tl.int64) * N + n
    tl.store(D_MIX + d_mix_rows[:, None] * S + s_ids[None, :], d_mix, mask=n_mask[:, None] & (s_ids < S)[None, :])


def _forward(shared, mix, generated, wrap):
    num_seqs, num_summary, width = generated.shape
    num_kv = shared.shape[0]
    out = generated.new_empty(num_seqs, num_kv, width)
    if out.numel():
        grid = (triton.cdiv(width, FWD_BLOCK_C), triton.cdiv(num_kv, FWD_BLOCK_N), triton.cdiv(num_seqs, FWD_SEQS))
        wrap(_generate_kernel)[grid](
            shared,
            mix,
            generated,
            out,
            num_seqs,
            num_kv,
            width,
            shared.stride(0),
            mix.stride(0),
            mix.stride(1),
            generated.stride(0),
            generated.stride(1),
            out.stride(0),
            out.stride(1),
            S=num_summary,
            BLOCK_N=FWD_BLOCK_N,
            BLOCK_C=FWD_BLOCK_C,
            SEQS=FWD_SEQS,
            num_warps=4,
        )
    return out


def _backward(grad, shared, mix, generated, wrap):
    num_seqs, num_summary, width = generated.shape
    num_kv = shared.shape[0]
    blocks_c, blocks_n = triton.cdiv(width, BWD_BLOCK_C), triton.cdiv(num_kv, BWD_BLOCK_N)
    groups = triton.cdiv(num_seqs, BWD_SEQS)
    f32 = dict(dtype=torch.float32, device=grad.device)
    d_shared = torch.empty(groups, num_kv, width, **f32)
    d_mix = torch.empty(groups, blocks_c, num_kv, num_summary, **f32)
    d_gen = torch.empty(blocks_n, num_seqs, num_summary, width, **f32)
    if grad.numel():
        wrap(_generate_bwd_kernel)[(blocks_c, blocks_n, groups)](
            grad,
            mix,
            generated,
            d_shared,
            d_mix,
            d_gen,
            num_seqs,
            num_kv,
            width,
            grad.stride(0),
            grad.stride(1),
            mix.stride(0),
            mix.stride(1),
            generated.stride(0),
            generated.stride(1),
            S=num_summary,
            BLOCK_N=BWD_BLOCK_N,
            BLOCK_C=BWD_BLOCK_C,
            BLOCK_S=triton.next_power_of_2(num_summary),
            SEQS=BWD_SEQS,
            num_warps=8,
        )
    return (
        d_shared.sum(0).to(shared.dtype),
        d_mix.sum((0, 1)).to(mix.dtype),
        d_gen.sum(0).to(generated.dtype),
    )


@define_op("gem_kernels::generated_weights_fwd")
def _fwd_op(shared: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    return _forward(shared, mix, generated, OP_WRAP)


@define_op("gem_kernels::generated_weights_bwd")
def _bwd_op(
    grad: torch.Tensor, shared: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, shared, mix, generated, OP_WRAP)


fake_without_launch(_fwd_op, _forward)
fake_without_launch(_bwd_op, _backward)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grad(ctx, grad):
    shared, mix, generated = ctx.saved_tensors
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    return torch.ops.gem_kernels.generated_weights_bwd(grad, shared, mix, generated)


torch.library.register_autograd("gem_kernels::generated_weights_fwd", _grad, setup_context=_setup_context)


def check_inputs(shared: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor) -> None:
    """A ValueError naming the argument unless the shapes are ``shared [N, C]``, ``mix [N, S]``
    and ``generated [B, S, C]``."""
    if shared.dim() != 2 or mix.dim() != 2 or generated.dim() != 3:
        raise ValueError(
            f"expected shared [N, C], mix [N, S], generated [B, S, C]; got {tuple(shared.shape)}, "
            f"{tuple(mix.shape)}, {tuple(generated.shape)}"
        )
    if mix.shape[0] != shared.shape[0]:
        raise ValueError(f"mix has {mix.shape[0]} rows, shared {shared.shape[0]}: both are N")
    if generated.shape[1:] != (mix.shape[1], shared.shape[1]):
        raise ValueError(
            f"generated must be [B, S, C] = [B, {mix.shape[1]}, {shared.shape[1]}] (S from mix, C from shared), "
            f"got {tuple(generated.shape)}"
        )


def generated_weights(
    shared: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """``shared + mix @ generated[b]`` for every example ``b``: ``[N, C] + [N, S] @ [B, S, C] -> [B, N, C]``,
    in ``generated``'s dtype (float32 math, rounded once).

    Args:
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, the reference elsewhere).
            Triton reads every tensor with its last dimension contiguous (copying one that is not).

    Differentiable in all three.
    """
    check_inputs(shared, mix, generated)
    if backend is None:
        backend = "triton" if generated.is_cuda else "reference"
    if backend == "reference":
        return generated_weights_reference(shared, mix, generated)
    if backend != "triton":
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS} or None")
    shared, generated = (t if t.stride(-1) == 1 else t.contiguous() for t in (shared, generated))
    return torch.ops.gem_kernels.generated_weights_fwd(shared, mix, generated)
