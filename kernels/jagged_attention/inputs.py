"""Random jagged attention inputs, shared by the tests and benchmarks/attention.py."""

from __future__ import annotations

import dataclasses

import torch

from kernels.jagged import lengths_to_offsets

LAYOUTS = ("jagged", "dense_kv", "broadcast_q")


def random_lengths(
    num_batches: int, max_len: int, fill: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Lengths as in Meta's GDPA benchmark: ``fill >= 1`` gives every example ``max_len``;
    ``fill < 1`` draws uniformly from ``[1, 2 * fill * max_len)`` (fill 0.5: ``[1, max_len)``)."""
    if fill >= 1.0:
        return torch.full((num_batches,), max_len, dtype=torch.int64)
    high = max(2, min(max_len, round(2 * fill * max_len)))
    return torch.randint(1, high, (num_batches,), generator=generator)


@dataclasses.dataclass
class JaggedAttentionInputs:
    """Positional arguments of :func:`kernels.jagged_attention`, plus the true lengths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_offsets: torch.Tensor | None
    kv_offsets: torch.Tensor | None
    max_q_len: int | None
    max_kv_len: int | None
    q_lengths: torch.Tensor  # [B], on the CPU
    kv_lengths: torch.Tensor  # [B], on the CPU

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.q_offsets, self.kv_offsets, self.max_q_len, self.max_kv_len)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v


def make_inputs(
    q_lengths: torch.Tensor | list[int],
    kv_lengths: torch.Tensor | list[int] | None = None,
    *,
    num_heads: int = 2,
    head_dim: int = 32,
    layout: str = "jagged",
    num_dense_kv: int = 16,
    num_queries: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    offsets_dtype: torch.dtype = torch.int64,
    max_len_slack: int = 0,
    requires_grad: bool = True,
    generator: torch.Generator | None = None,
) -> JaggedAttentionInputs:
    """Draws q, k, v (standard normal) for one of the layouts.

    Args:
        q_lengths: ``[B]`` query lengths (ignored for ``broadcast_q``, which uses
            ``num_queries`` shared queries).
        kv_lengths: ``[B]`` key lengths, default ``q_lengths`` (ignored for ``dense_kv``,
            which uses ``num_dense_kv`` keys per example).
        layout: ``"jagged"`` (jagged Q and K/V), ``"dense_kv"`` (K/V ``[B, N, H, D]``),
            ``"broadcast_q"`` (Q ``[N, H, D]`` shared by the batch).
        max_len_slack: added to the true maximum lengths passed as ``max_*_len``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    q_lengths = torch.as_tensor(q_lengths, dtype=torch.int64)
    kv_lengths = q_lengths if kv_lengths is None else torch.as_tensor(kv_lengths, dtype=torch.int64)
    num_batches = kv_lengths.numel() if layout == "broadcast_q" else q_lengths.numel()

    def randn(*shape):
        x = torch.randn(*shape, generator=generator, dtype=torch.float32)
        return x.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    def max_len(lengths):
        return (int(lengths.max()) if lengths.numel() else 0) + max_len_slack

    if layout == "broadcast_q":
        q_lengths = torch.full((num_batches,), num_queries, dtype=torch.int64)
        q, q_offsets, max_q_len = randn(num_queries, num_heads, head_dim), None, None
    else:
        q = randn(int(q_lengths.sum()), num_heads, head_dim)
        q_offsets = lengths_to_offsets(q_lengths, offsets_dtype).to(device)
        max_q_len = max_len(q_lengths)
    if layout == "dense_kv":
        kv_lengths = torch.full((num_batches,), num_dense_kv, dtype=torch.int64)
        shape = (num_batches, num_dense_kv, num_heads, head_dim)
        k, v, kv_offsets, max_kv_len = randn(*shape), randn(*shape), None, None
    else:
        kv_lengths = kv_lengths[:num_batches]
        total = int(kv_lengths.sum())
        k, v = randn(total, num_heads, head_dim), randn(total, num_heads, head_dim)
        kv_offsets = lengths_to_offsets(kv_lengths, offsets_dtype).to(device)
        max_kv_len = max_len(kv_lengths)
    return JaggedAttentionInputs(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, q_lengths, kv_lengths)


def generated_kv_inputs(
    lengths: torch.Tensor | list[int],
    *,
    num_heads: int,
    head_dim: int,
    num_kv: int,
    num_summary: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> tuple:
    """The positional arguments of :func:`kernels.jagged_attention.generated_kv.generated_kv_forward`
    (``q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v``), drawn as the personalized FFN
    holds them: ``W0`` (scaled by ``head_dim ** -0.5``) and ``M`` float32 parameters, ``q`` and ``G``
    in ``dtype``."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    width = num_heads * head_dim

    def randn(*shape, to_dtype=dtype):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=to_dtype)

    q = randn(int(lengths.sum()), num_heads, head_dim)
    shared_k, shared_v = (randn(num_kv, width, to_dtype=torch.float32) * head_dim**-0.5 for _ in range(2))
    mix = randn(num_kv, num_summary, to_dtype=torch.float32)
    gen_k, gen_v = (randn(lengths.numel(), num_summary, width) for _ in range(2))
    max_len = int(lengths.max()) if lengths.numel() else 0
    return q, lengths_to_offsets(lengths).to(device), max_len, shared_k, shared_v, mix, gen_k, gen_v
