"""InterFormer (arXiv 2411.09852): interleaved learning of non-sequence and sequence features.

One layer, data flow (``X [B, F, d]`` non-sequence tokens; ``S`` jagged rows of each event
stream, with ``N`` CLS tokens prepended once, before the first layer)::

          X ──────────────┬──────────────────────────────┐
          │          Cross Arch: X_sum = gate(W flat(X))  │
          │               │ [B, N, d]                     │
          │               ▼                               │
    S ──► Cross Arch: S_sum = gate(W [CLS rows;           │
     │      PMA(S); K most recent rows])  [B, M_s, d]     │
     │          │                                         ▼
     │          └──────────────► Interaction Arch: X' = X + LN(Σ_i interaction_i([X; S_sum]))
     ▼                                          (dot / DCNv2 side by side: DHEN-style)
    Sequence Arch: S' = MHA_rope(PFFN(S | X_sum))   (jagged softmax attention, CLS included)

Both arches read the other's summary of the *same* layer input, so information flows both
ways in every layer. The CLS tokens come from ``X_sum``, which holds the candidate's tokens:
attention from them to the history is target-aware.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.models.interaction import InteractionEnsemble
from gem.models.sequence import (
    JaggedSelfAttention,
    PersonalizedFFN,
    PoolingByAttention,
    SelfGate,
    linear_flops,
)
from gem.sparse.arch import JaggedEmbeddings
from kernels.jagged import jagged_first, jagged_last


class NonSequenceSummary(nn.Module):
    """``X [B, F, d]`` -> ``X_sum [B, N, d]``: one linear map of the flattened tokens, then self-gating."""

    def __init__(self, num_tokens: int, num_summary: int, dim: int) -> None:
        super().__init__()
        self.num_summary, self.dim = num_summary, dim
        self.proj = nn.Linear(num_tokens * dim, num_summary * dim)
        self.gate = SelfGate(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.proj(x.flatten(1)).view(x.shape[0], self.num_summary, self.dim))

    def flops(self, batch_size: int) -> int:
        return linear_flops(batch_size, self.proj.in_features, self.proj.out_features) + self.gate.flops(
            batch_size * self.num_summary
        )


class SequenceSummary(nn.Module):
    """InterFormer's sequence summary: the ``num_cls`` CLS rows, ``num_pma`` PMA tokens and the
    ``num_recent`` most recent rows of each example (CLS rows too when the history is shorter),
    projected to ``dim`` and self-gated: ``[B, num_cls + num_pma + num_recent, dim]``."""

    def __init__(
        self,
        stream_dim: int,
        num_heads: int,
        dim: int,
        num_cls: int,
        num_pma: int,
        num_recent: int,
        backend: str | None,
        pool_rows: bool | None = None,
    ) -> None:
        super().__init__()
        self.num_cls, self.num_recent = num_cls, num_recent
        self.num_tokens = num_cls + num_pma + num_recent
        self.pma = PoolingByAttention(stream_dim, num_heads, num_pma, backend, pool_rows) if num_pma else None
        self.proj = nn.Linear(stream_dim, dim)
        self.gate = SelfGate(dim)

    def forward(self, s: JaggedEmbeddings) -> torch.Tensor:
        parts = [jagged_first(s.values, s.offsets, self.num_cls)]
        if self.pma is not None:
            parts.append(self.pma(s.values, s.offsets, s.max_len))
        if self.num_recent:
            parts.append(jagged_last(s.values, s.offsets, self.num_recent)[0])
        return self.gate(self.proj(torch.cat(parts, dim=1)))

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        rows = lengths.numel() * self.num_tokens
        total = linear_flops(rows, self.proj.in_features, self.proj.out_features) + self.gate.flops(rows)
        return total + (self.pma.flops(lengths, max_len, padded) if self.pma is not None else 0)


class InterFormerLayer(nn.Module):
    """One InterFormer layer over ``F`` non-sequence tokens of width ``dim`` and the given streams.

    Args:
        streams: per event stream, ``(name, width, num_heads, window)``.
        num_summary: ``N``, tokens in ``X_sum`` (= CLS tokens per stream).
        interaction: names for the DHEN-style ensemble, e.g. ``["dot", "dcnv2"]``.
        pffn_kv / pffn_activation: hidden width and activation of the personalized FFN.
        num_pma / num_recent: PMA tokens and most recent rows in each sequence summary.
        pool_rows: how PMA computes (gem.models.sequence.PoolingByAttention; None: by its rule).
        row_bias: biases on the projections of every event row (self-attention's Q/K/V and output,
            the personalized FFN's output).
    """

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        streams: list[tuple[str, int, int, int | None]],
        num_summary: int,
        interaction: list[str],
        pffn_kv: int,
        pffn_activation: str,
        num_pma: int,
        num_recent: int,
        backend: str | None = None,
        pool_rows: bool | None = None,
        row_bias: bool = True,
    ) -> None:
        super().__init__()
        self.x_summary = NonSequenceSummary(num_tokens, num_summary, dim)
        self.s_summary = nn.ModuleDict(
            {
                name: SequenceSummary(width, heads, dim, num_summary, num_pma, num_recent, backend, pool_rows)
                for name, width, heads, _ in streams
            }
        )
        num_in = num_tokens + sum(m.num_tokens for m in self.s_summary.values())
        self.interaction = InteractionEnsemble(list(interaction), num_in, num_tokens, dim)
        self.pffn = nn.ModuleDict(
            {
                name: PersonalizedFFN(width, heads, dim, num_summary, pffn_kv, pffn_activation, backend, bias=row_bias)
                for name, width, heads, _ in streams
            }
        )
        self.attention = nn.ModuleDict(
            {
                name: JaggedSelfAttention(width, heads, window, backend, bias=row_bias)
                for name, width, heads, window in streams
            }
        )

    def forward(
        self, x: torch.Tensor, seqs: dict[str, JaggedEmbeddings], rope: dict[str, tuple] | None = None
    ) -> tuple[torch.Tensor, dict[str, JaggedEmbeddings]]:
        """``rope``: per stream, its rotary tables (gem.models.sequence.rotary_tables); None: computed here."""
        rope = rope or {}
        x_sum = self.x_summary(x)  # Cross Arch, both ways
        s_sums = [self.s_summary[name](s) for name, s in seqs.items()]
        x_next = self.interaction(torch.cat([x, *s_sums], dim=1))  # Interaction Arch
        out = {}
        for name, s in seqs.items():  # Sequence Arch
            values = self.pffn[name](s.values, s.offsets, s.max_len, x_sum)
            values = self.attention[name](values, s.offsets, s.max_len, rope.get(name))
            out[name] = JaggedEmbeddings(values, s.offsets, s.max_len)
        return x_next, out

    def flops(self, batch_size: int, lengths: dict[str, torch.Tensor], max_lens: dict[str, int], padded: bool) -> int:
        total = self.x_summary.flops(batch_size) + self.interaction.flops(batch_size)
        for name, n in lengths.items():
            total += (
                self.s_summary[name].flops(n, max_lens[name], padded)
                + self.pffn[name].flops(n, max_lens[name], padded)
                + self.attention[name].flops(n, max_lens[name], padded)
            )
        return total
