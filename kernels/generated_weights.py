"""The gradients of the personalized FFN's per-example weights ``W_0 + M G_b``, from one read of the gradient.

The forward, ``out[b] = shared + mix @ generated[b]`` (``shared [N, C]``, ``mix [N, S]``,
``generated [B, S, C]``, ``S`` a few summary tokens), is one fused Inductor kernel under
torch.compile (``gem.models.sequence.generate_weights``). Its backward needs three sums of the
gradient ``grad [B, N, C]``::

    d_shared = sum_b grad[b]                 [N, C]
    d_mix    = sum_b grad[b] @ generated[b]^T [N, S]
    d_gen[b] = mix^T @ grad[b]               [B, S, C]

As PyTorch (a sum over the batch, a batched GEMM, a GEMM) they read the gradient three times: 268
MB a call at gem_base's shapes (B = 1,024, N = 256, C = 512). :func:`generated_weights_backward`
reads it once: one program a ``[BLOCK_N, BLOCK_C]`` tile of ``grad`` for a group of examples in
turn, adding the tile into ``d_shared``'s float32 accumulator and taking ``d_mix``'s and
``d_gen``'s products on the tensor cores (``S`` padded to 16). Partial sums, float32, summed after:
per group of examples (``d_shared``, ``d_mix``) and per block of ``N`` (``d_gen``); no atomics, so
the result does not depend on scheduling. ``mix`` enters ``d_gen``'s product in ``grad``'s dtype (as
the GEMM it replaces took it); every sum is float32.

``backend="reference"`` (the default off CUDA) is the PyTorch it replaces, which the compiled
``generate_weights`` keeps without the Triton backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fallback
from kernels.jagged_attention.triton_common import (
    OP_WRAP,
    define_op,
    dot,
    fake_without_launch,
    identity,
    resolve_backend,
)

BLOCK_C = 64  # gradient columns per program
MAX_BLOCK_N = 256  # gradient rows per program (N up to this in one block: no partial sums of d_gen)
SEQS = 32  # examples per program, in turn


def generated_weights_backward_reference(
    grad: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`generated_weights_backward` as the PyTorch it replaces: a float32 sum over the batch,
    a batched GEMM (each example's product in ``grad``'s dtype) summed in float32, and a GEMM."""
    d_shared = grad.sum(0, dtype=torch.float32)
    d_mix = torch.bmm(grad, generated.transpose(1, 2)).sum(0, dtype=torch.float32)
    d_gen = torch.matmul(mix.t().to(grad.dtype), grad)
    return d_shared, d_mix.to(mix.dtype), d_gen.to(generated.dtype)


@triton.jit
def _bwd_kernel(
    GRAD,
    MIX_T,
    GEN,
    D_SHARED,
    D_MIX,
    D_GEN,
    num_seqs,
    N,
    C,
    stride_grad_b,
    stride_grad_n,
    stride_gen_b,
    stride_gen_s,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SEQS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One ``[BLOCK_N, BLOCK_C]`` tile of GRAD for SEQS examples. Writes float32 partials, contiguous:
    D_SHARED [groups, N, C], D_MIX [groups, c blocks, N, S], D_GEN [n blocks, B, S, C].
    MIX_T: ``mix^T`` ``[S, N]`` in GRAD's dtype, contiguous."""
    pid_c, pid_n, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    n_mask, c_mask, s_mask = n < N, c < C, s < S
    tile_mask = n_mask[:, None] & c_mask[None, :]
    mix_t = tl.load(MIX_T + s[:, None] * N + n[None, :], mask=s_mask[:, None] & n_mask[None, :], other=0.0)
    d_shared = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    d_mix = tl.zeros([BLOCK_N, BLOCK_S], tl.float32)
    for i in range(SEQS):
        b = (group * SEQS + i).to(tl.int64)
        valid = b < num_seqs
        grad = tl.load(
            GRAD + b * stride_grad_b + n[:, None] * stride_grad_n + c[None, :], mask=tile_mask & valid, other=0.0
        )
        gen_t = tl.load(  # [BLOCK_C, BLOCK_S]: generated[b]^T
            GEN + b * stride_gen_b + s[None, :] * stride_gen_s + c[:, None],
            mask=c_mask[:, None] & s_mask[None, :] & valid,
            other=0.0,
        ).to(grad.dtype)
        d_shared += grad.to(tl.float32)
        d_mix = dot(grad, gen_t, d_mix, DOT_PRECISION)
        d_gen = dot(mix_t, grad, tl.zeros([BLOCK_S, BLOCK_C], tl.float32), DOT_PRECISION)
        rows = (pid_n * num_seqs + b) * S + s
        tl.store(D_GEN + rows[:, None] * C + c[None, :], d_gen, mask=s_mask[:, None] & c_mask[None, :] & valid)
    tl.store(D_SHARED + (group.to(tl.int64) * N + n[:, None]) * C + c[None, :], d_shared, mask=tile_mask)
    mix_rows = (group * tl.num_programs(0) + pid_c).to(tl.int64) * N + n
    tl.store(D_MIX + mix_rows[:, None] * S + s[None, :], d_mix, mask=n_mask[:, None] & s_mask[None, :])


def _backward(grad, mix, generated, wrap):
    num_seqs, num_summary, width = generated.shape
    num_kv = mix.shape[0]
    block_n = min(MAX_BLOCK_N, max(16, triton.next_power_of_2(num_kv)))
    blocks_c, blocks_n, groups = triton.cdiv(width, BLOCK_C), triton.cdiv(num_kv, block_n), triton.cdiv(num_seqs, SEQS)
    f32 = dict(dtype=torch.float32, device=grad.device)
    d_shared = torch.empty(groups, num_kv, width, **f32)
    d_mix = torch.empty(groups, blocks_c, num_kv, num_summary, **f32)
    d_gen = torch.empty(blocks_n, num_seqs, num_summary, width, **f32)
    if grad.numel():
        wrap(_bwd_kernel)[(blocks_c, blocks_n, groups)](
            grad,
            mix.t().to(grad.dtype).contiguous(),
            generated,
            d_shared,
            d_mix,
            d_gen,
            num_seqs,
            num_kv,
            width,
            grad.stride(0),
            grad.stride(1),
            generated.stride(0),
            generated.stride(1),
            S=num_summary,
            BLOCK_N=block_n,
            BLOCK_C=BLOCK_C,
            BLOCK_S=max(16, triton.next_power_of_2(num_summary)),
            SEQS=SEQS,
            DOT_PRECISION="ieee" if grad.dtype == torch.float32 else "tf32",  # (tf32: unused by 16-bit dots)
            num_warps=8,
        )
    return d_shared.sum(0), d_mix.sum((0, 1)).to(mix.dtype), d_gen.sum(0).to(generated.dtype)


@define_op("gem_kernels::generated_weights_bwd")
def _bwd_op(
    grad: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, mix, generated, OP_WRAP)


fake_without_launch(_bwd_op, _backward)


def generated_weights_backward(
    grad: torch.Tensor, mix: torch.Tensor, generated: torch.Tensor, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_shared, d_mix, d_gen)`` of ``out[b] = shared + mix @ generated[b]`` from ``grad [B, N, C]``:
    ``d_shared`` float32 ``[N, C]``, ``d_mix`` ``[N, S]`` in ``mix``'s dtype, ``d_gen`` ``[B, S, C]``
    in ``generated``'s.

    Args:
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, the reference elsewhere).
            Triton reads ``grad`` and ``generated`` with their last dimension contiguous (copying
            one that is not).
    """
    if grad.dim() != 3 or mix.dim() != 2 or generated.dim() != 3:
        raise ValueError(
            f"expected grad [B, N, C], mix [N, S], generated [B, S, C]; got {tuple(grad.shape)}, "
            f"{tuple(mix.shape)}, {tuple(generated.shape)}"
        )
    num_seqs, num_kv, width = grad.shape
    if generated.shape != (num_seqs, mix.shape[1], width) or mix.shape[0] != num_kv:
        raise ValueError(
            f"with grad [B, N, C] = {list(grad.shape)}, mix must be [N, S] and generated [B, S, C]; got mix "
            f"{list(mix.shape)}, generated {list(generated.shape)}"
        )
    variant = tuple(fallback.dtype_name(t) for t in (grad, mix, generated))
    if resolve_backend(backend, grad, "generated_weights", variant) == "reference":
        return generated_weights_backward_reference(grad, mix, generated)
    grad, generated = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad, generated))
    return torch.ops.gem_kernels.generated_weights_bwd(grad, mix, generated)


def _probe(grad_dtype: str, mix_dtype: str, generated_dtype: str, device: int) -> None:
    """The kernel of a variant, launched once on tiny inputs (kernels.fallback)."""

    grad = torch.randn(3, 16, 64, device=fallback.device_of(device), dtype=getattr(torch, grad_dtype))
    mix = torch.randn(16, 4, device=grad.device, dtype=getattr(torch, mix_dtype))
    generated = torch.randn(3, 4, 64, device=grad.device, dtype=getattr(torch, generated_dtype))
    _backward(grad, mix, generated, identity)


fallback.PROBES["generated_weights"] = _probe
