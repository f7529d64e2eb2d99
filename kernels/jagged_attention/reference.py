"""Plain PyTorch reference for jagged attention: the spec of every mode.

The reference pads each example to ``[B, max_len, H, D]`` internally (padding is allowed
only here, see DESIGN.md), builds the explicit ``[B, H, Lq, Lkv]`` score matrix and the
explicit mask, and takes gradients through ordinary autograd. It runs on any device.

Notation used in all docstrings of this package, for example ``b`` with query length
``Lq[b]`` and key length ``Lkv[b]``, query position ``i`` and key position ``j`` (both
counted from the start of the example's own rows):

* ``S = scale * Q K^T`` (``scale`` defaults to ``1 / sqrt(D)``).
* Key ``j`` is visible to query ``i`` iff ``j < Lkv[b]`` and each requested mask holds:
  ``causal``: ``j <= i``; ``window=w``: ``|i - j| <= w`` (with ``causal``: ``0 <= i - j <= w``);
  ``block_size=s``: ``i // s == j // s`` (BlockAttention: every query block of ``s`` rows
  attends only to the key block with the same index, so cost is linear in length).
* ``activation="softmax"`` (Jagged Flash Attention): ``O = softmax(S masked to -inf) V``;
  a query that sees no key gets ``O = 0``.
* pointwise activations (GDPA): ``O = (post_scale * act(S) * visible) V``, no normalization,
  with ``post_scale`` defaulting to ``1 / max_kv_len`` and

  =============  ==============================================================
  ``silu``       ``x * sigmoid(x)``
  ``gelu``       ``0.5 * x * (1 + erf(x / sqrt(2)))``
  ``fast_gelu``  ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``
  ``relu``       ``max(x, 0)``
  ``identity``   ``x``
  =============  ==============================================================
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.jagged import jagged_to_padded, padded_to_jagged

ACTIVATIONS = ("softmax", "silu", "gelu", "fast_gelu", "relu", "identity")


def pointwise_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Applies one of the GDPA pointwise activations (see module docstring)."""
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "fast_gelu":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "identity":
        return x
    raise ValueError(f"unknown pointwise activation {activation!r}; expected one of {ACTIVATIONS}")


def visible_mask(
    q_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Returns the boolean mask of visible (query, key) pairs, ``[B, max_q_len, max_kv_len]``."""
    i = torch.arange(max_q_len, device=q_lengths.device)[:, None]  # [Lq, 1]
    j = torch.arange(max_kv_len, device=q_lengths.device)[None, :]  # [1, Lkv]
    mask = (i < q_lengths[:, None, None]) & (j < kv_lengths[:, None, None])  # [B, Lq, Lkv]
    if causal:
        mask = mask & (j <= i)
    if window is not None:
        mask = mask & ((i - j).abs() <= window)
    if block_size is not None:
        mask = mask & (i // block_size == j // block_size)
    return mask


def num_visible_pairs(
    q_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
) -> int:
    """Number of visible (query, key) pairs summed over the batch, without padding.

    Every mask keeps one interval of keys per query, so this is ``sum_i (hi_i - lo_i)^+`` over
    all query rows. Forward FLOPs are ``4 * H * D * num_visible_pairs`` (two matmuls).
    """
    q_lengths = q_lengths.detach().long().cpu()
    kv_lengths = kv_lengths.detach().long().cpu()
    if not (causal or window is not None or block_size is not None):
        return int((q_lengths * kv_lengths).sum())
    pos = torch.arange(int(q_lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(q_lengths, 0) - q_lengths, q_lengths
    )  # position of each query row inside its example
    lo = torch.zeros_like(pos)
    hi = torch.repeat_interleave(kv_lengths, q_lengths)
    if causal:
        hi = torch.minimum(hi, pos + 1)
    if window is not None:
        lo = torch.maximum(lo, pos - window)
        hi = torch.minimum(hi, pos + window + 1)
    if block_size is not None:
        lo = torch.maximum(lo, pos // block_size * block_size)
        hi = torch.minimum(hi, (pos // block_size + 1) * block_size)
    return int((hi - lo).clamp(min=0).sum())


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor | None,
    max_q_len: int | None,
    max_kv_len: int | None,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    post_scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Jagged attention, computed on padded tensors in float32 (the spec).

    Takes the same arguments and layouts as :func:`kernels.jagged_attention`:
    ``q`` is ``[Tq, H, D]`` with ``q_offsets [B+1]``, or ``[N, H, D]`` shared by every example
    when ``q_offsets`` is None (the output is then ``[B, N, H, D]``); ``k``/``v`` are
    ``[Tkv, H, D]`` with ``kv_offsets [B+1]``, or dense ``[B, N, H, D]`` when ``kv_offsets``
    is None. Computes in float32 (float64 for float64 inputs); returns ``q.dtype``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    out_dtype = q.dtype
    compute_dtype = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    if kv_offsets is None:  # dense K/V [B, N, H, D]
        num_batches, max_kv_len = k.shape[0], k.shape[1]
        k_pad, v_pad = k.to(compute_dtype), v.to(compute_dtype)
        kv_lengths = torch.full((num_batches,), max_kv_len, device=k.device, dtype=torch.long)
    else:
        num_batches = kv_offsets.numel() - 1
        k_pad = jagged_to_padded(k.to(compute_dtype), kv_offsets, max_kv_len)
        v_pad = jagged_to_padded(v.to(compute_dtype), kv_offsets, max_kv_len)
        kv_lengths = (kv_offsets[1:] - kv_offsets[:-1]).long()
    if post_scale is None:
        post_scale = 1.0 / max(max_kv_len, 1)

    if q_offsets is None:  # one Q [N, H, D] broadcast over the batch
        max_q_len = q.shape[0]
        q_pad = q.to(compute_dtype)[None].expand(num_batches, *q.shape)
        q_lengths = torch.full((num_batches,), max_q_len, device=q.device, dtype=torch.long)
    else:
        q_pad = jagged_to_padded(q.to(compute_dtype), q_offsets, max_q_len)
        q_lengths = (q_offsets[1:] - q_offsets[:-1]).long()

    mask = visible_mask(q_lengths, kv_lengths, max_q_len, max_kv_len, causal, window, block_size)
    mask = mask[:, None]  # [B, 1, Lq, Lkv]
    s = torch.einsum("bihd,bjhd->bhij", q_pad, k_pad) * scale  # [B, H, Lq, Lkv]
    if activation == "softmax":
        sees_any_key = mask.any(dim=-1, keepdim=True)  # a query that sees no key gets O = 0
        s = s.masked_fill(~mask, float("-inf")).masked_fill(~sees_any_key, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(~mask, 0.0)
    else:
        p = pointwise_activation(s, activation) * post_scale
        p = p.masked_fill(~mask, 0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, v_pad)  # [B, Lq, H, D]

    if q_offsets is None:
        return o.to(out_dtype)
    return padded_to_jagged(o, q_offsets, q.shape[0]).to(out_dtype)
