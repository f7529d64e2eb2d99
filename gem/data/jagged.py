"""Helpers for jagged tensors: ``values [T, ...]`` + ``offsets [B+1]`` + a host-side ``max_len``.

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


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B+1]`` int64 offsets starting at 0."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


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


def jagged_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of each sequence: ``values [T, D]`` -> ``[B, D]``; empty sequences give zeros."""
    ids = segment_ids(offsets, values.shape[0])
    return values.new_zeros(offsets.numel() - 1, *values.shape[1:]).index_add_(0, ids, values)


def jagged_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence: ``values [T, D]`` -> ``[B, D]``; empty sequences give zeros."""
    sums = jagged_sum(values, offsets)
    lengths = offsets_to_lengths(offsets).clamp_min(1).to(values.dtype)
    return sums / lengths.view(-1, *([1] * (values.dim() - 1)))


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


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad: float = 0.0) -> torch.Tensor:
    """Reference only: ``values [T, *F]`` -> ``[B, max_len, *F]`` (sequences longer than max_len are cut)."""
    num_seqs = offsets.numel() - 1
    out = values.new_full((num_seqs, max_len, *values.shape[1:]), pad)
    lengths = offsets_to_lengths(offsets).clamp_max(max_len)
    ids = segment_ids(offsets, values.shape[0])
    pos = torch.arange(values.shape[0], device=values.device) - offsets[ids]
    keep = pos < lengths[ids]
    out[ids[keep], pos[keep]] = values[keep]
    return out


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference only: inverse of :func:`jagged_to_padded` for sequences no longer than ``padded.shape[1]``."""
    ids = segment_ids(offsets)
    pos = torch.arange(ids.numel(), device=padded.device) - offsets[ids]
    return padded[ids, pos]


def check_offsets(offsets: torch.Tensor, total: int, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``offsets`` is a valid ``[B+1]`` offsets tensor for ``T = total``."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name}: offsets must be a 1-D tensor of B+1 entries, got shape {tuple(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise ValueError(f"{name}: offsets must start at 0 and end at T={total}, got {int(offsets[0])} .. {int(offsets[-1])}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{name}: offsets must be nondecreasing")
