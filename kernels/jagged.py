"""Helpers for jagged tensors: ``values [T, ...]`` + ``offsets [B+1]`` + a host-side ``max_len``.

The single home of these helpers: the data pipeline, the models and the kernels' references all
import them from here (torch only; nothing in kernels imports gem).

The convention (docs/design.md): rows of all sequences lie back to back in ``values``;
``offsets[0] == 0``, offsets are nondecreasing and ``offsets[-1] == T``; empty sequences are
legal. Padding appears only in references and in tests, never on the training path.

Example, three histories of lengths 2, 0 and 1::

    #            i = 0      i = 1   i = 2   <- batch
    # values     [a, b]     []      [c]     -> values = [a, b, c]   # [T=3, D]
    # offsets    [0,        2,      2,      3]                      # [B+1]
"""

from __future__ import annotations

import torch


def lengths_to_offsets(lengths: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[B]`` lengths -> ``[B+1]`` offsets starting at 0, on the lengths' device (int64 unless
    ``dtype`` says otherwise: the kernels also take int32)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets.to(dtype)


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """``[B+1]`` offsets -> ``[B]`` lengths (same dtype)."""
    return offsets[1:] - offsets[:-1]


def segment_ids(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The example index of every row of ``values``: ``[T]`` int64.

    ``total`` (= T) may be given to avoid a device-to-host sync.
    """
    lengths = offsets_to_lengths(offsets)
    batch = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(batch, lengths, output_size=total)


def jagged_positions(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """The position of every row inside its own sequence, ``[T]`` int64 (0 = oldest)."""
    return torch.arange(total, device=offsets.device) - offsets[segment_ids(offsets, total)]


def jagged_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of each sequence: ``values [T, D]`` -> ``[B, D]``; empty sequences give zeros."""
    ids = segment_ids(offsets, values.shape[0])
    return values.new_zeros(offsets.numel() - 1, *values.shape[1:]).index_add_(0, ids, values)


def jagged_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence: ``values [T, D]`` -> ``[B, D]``; empty sequences give zeros."""
    sums = jagged_sum(values, offsets)
    lengths = offsets_to_lengths(offsets).clamp_min(1).to(values.dtype)
    return sums / lengths.view(-1, *([1] * (values.dim() - 1)))


def jagged_first(values: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of every sequence (each must hold at least ``n``): ``[B, n, D]``."""
    return values[offsets[:-1, None] + torch.arange(n, device=offsets.device)]


def jagged_last(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most recent rows of each sequence, right-aligned: ``[B, k, D]`` and a mask ``[B, k]``.

    Sequences shorter than ``k`` are left-filled with zeros (mask False). Histories are stored
    oldest first, so the most recent event is the last row of each sequence.
    """
    num_seqs = offsets.numel() - 1
    lengths = offsets_to_lengths(offsets)
    pos = torch.arange(-k, 0, device=values.device)  # -k .. -1
    mask = pos.unsqueeze(0) >= -lengths.unsqueeze(1)  # [B, k]
    if values.shape[0] == 0:
        return values.new_zeros(num_seqs, k, *values.shape[1:]), mask
    idx = (offsets[1:].unsqueeze(1) + pos.unsqueeze(0)).clamp_min(0)  # [B, k]
    rows = values[idx] * mask.view(num_seqs, k, *([1] * (values.dim() - 1))).to(values.dtype)
    return rows, mask


def jagged_prepend(
    prefix: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepend ``prefix [B, N, D]`` to every sequence of ``values [T, D]``: ``([T + B*N, D], offsets [B+1])``.

    A gather, no padding; empty sequences come out holding just their N prefix rows::

        #              i = 0          i = 1      <- batch
        # values       [h0 h1]        []            offsets [0, 2, 2]
        # prepended    [c0 c1 h0 h1]  [c0' c1']     offsets [0, 4, 6]
    """
    num_seqs, num_prefix = prefix.shape[0], prefix.shape[1]
    total = values.shape[0]
    shift = num_prefix * torch.arange(num_seqs + 1, device=offsets.device)
    new_offsets = offsets + shift
    prefix_dest = (new_offsets[:-1, None] + torch.arange(num_prefix, device=offsets.device)).reshape(-1)  # [B*N]
    values_dest = torch.arange(total, device=offsets.device) + shift[1:][segment_ids(offsets, total)]  # [T]
    source = torch.empty(total + num_seqs * num_prefix, dtype=torch.int64, device=offsets.device)
    source[prefix_dest] = torch.arange(num_seqs * num_prefix, device=offsets.device)
    source[values_dest] = num_seqs * num_prefix + torch.arange(total, device=offsets.device)
    return torch.cat([prefix.reshape(-1, prefix.shape[-1]), values])[source], new_offsets


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad: float = 0.0) -> torch.Tensor:
    """References and tests only: ``values [T, *F]`` -> ``[B, max_len, *F]`` filled with ``pad``.

    Sequences longer than ``max_len`` are cut. A gather, so it is differentiable: the gradient
    reaches ``values`` (zero for cut rows), also when ``T == 0``.
    """
    num_seqs = offsets.numel() - 1
    offsets = offsets.long()
    pos = torch.arange(max_len, device=values.device)
    valid = pos[None, :] < offsets_to_lengths(offsets)[:, None]  # [B, max_len]
    if values.shape[0] == 0:  # nothing to gather; stays connected to values' graph
        return values.new_full((num_seqs, max_len, *values.shape[1:]), pad) + values.sum() * 0
    rows = (offsets[:-1, None] + pos[None, :]).clamp(max=values.shape[0] - 1)  # [B, max_len]
    valid = valid.view(num_seqs, max_len, *([1] * (values.dim() - 1)))
    return torch.where(valid, values[rows], values.new_full((), pad))


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """References and tests only: ``[B, max_len, *F]`` -> ``[T, *F]``, the first ``length`` rows of
    each example (the inverse of :func:`jagged_to_padded` for sequences no longer than
    ``max_len``). Differentiable; ``total`` (= T) may be given to avoid a device-to-host sync."""
    offsets = offsets.long()
    if total is None:
        total = int(offsets[-1])
    ids = segment_ids(offsets, total)
    return padded[ids, torch.arange(total, device=offsets.device) - offsets[ids]]


def check_offsets(offsets: torch.Tensor, total: int, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``offsets`` is a valid ``[B+1]`` offsets tensor for ``T = total``."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name}: offsets must be a 1-D tensor of B+1 entries, got shape {tuple(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise ValueError(
            f"{name}: offsets must start at 0 and end at T={total}, got {int(offsets[0])} .. {int(offsets[-1])}"
        )
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{name}: offsets must be nondecreasing")
