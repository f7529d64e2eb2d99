"""Kunlun (arXiv 2602.10016) layers: GDPA-PFFN, sliding-window attention, hierarchical seed
pooling, CompSkip and a Wukong global interaction, with per-event-stream settings.

One layer, data flow (``X [B, F, d]`` non-sequence tokens; ``S`` jagged rows per stream; a
CompSkip layer skips the boxes marked *)::

    X ──► X_sum = gate(W flat(X)) [B, N, d] ─┐
    │                                        ▼ K_b, V_b [N_kv, H, D] per example
    │   S ──► * GDPA-PFFN: S + act(S K_b^T) V_b / N_kv   (jagged Q, dense K/V: one kernel call)
    │          ──► sliding-window MHA (window w_s per stream, rotary positions)
    │          ──► * seed pooling: N_seed learned queries attend to S ──► compress over seeds
    │                  to P tokens ──► [B, P, d]   (a skip layer reuses the previous layer's)
    ▼                                       │
    Wukong: X' = X + LN([FMB(Z) (or a mixture of FMB experts); LCB(Z)]),  Z = [X; pooled]

Per-stream width, heads and window let a long, cheap stream (impressions) and a short, rich
one (conversions) share the stack.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.models.interaction import WukongLayer
from gem.models.interformer import NonSequenceSummary
from gem.models.sequence import JaggedSelfAttention, PersonalizedFFN, PoolingByAttention, linear_flops
from gem.sparse.arch import JaggedEmbeddings


class SeedPooling(nn.Module):
    """Hierarchical seed pooling: ``num_seeds`` learned queries attend to the rows (softmax), a
    learned low-rank map over the seed axis compresses them to ``num_pooled`` tokens, projected
    to ``dim``: ``[B, num_pooled, dim]``."""

    def __init__(
        self,
        stream_dim: int,
        num_heads: int,
        dim: int,
        num_seeds: int,
        num_pooled: int,
        backend: str | None,
        pool_rows: bool | None = None,
    ) -> None:
        super().__init__()
        self.num_tokens, self.stream_dim = num_pooled, stream_dim
        self.seeds = PoolingByAttention(stream_dim, num_heads, num_seeds, backend, pool_rows)
        self.compress = nn.Linear(num_seeds, num_pooled, bias=False)
        self.proj = nn.Linear(stream_dim, dim)

    def forward(self, s: JaggedEmbeddings) -> torch.Tensor:
        seeds = self.seeds(s.values, s.offsets, s.max_len)  # [B, N_seed, D_s]
        return self.proj(self.compress(seeds.transpose(1, 2)).transpose(1, 2))

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        b = lengths.numel()
        return (
            self.seeds.flops(lengths, max_len, padded)
            + linear_flops(b * self.stream_dim, self.compress.in_features, self.compress.out_features)
            + linear_flops(b * self.num_tokens, self.proj.in_features, self.proj.out_features)
        )


class KunlunLayer(nn.Module):
    """One Kunlun layer.

    Args:
        streams: per event stream, ``(name, width, num_heads, window)``.
        skip: CompSkip - no PFFN and no pooling; reuse the summary the previous layer pooled.
        num_summary / pffn_kv / pffn_activation: the GDPA-PFFN (``N`` summary tokens generate
            ``N_kv`` keys and values per example).
        num_seeds / num_pooled: seed pooling.
        wukong: keyword arguments of :class:`WukongLayer` (rank, hidden, num_lcb, num_experts).
        pool_rows: how seed pooling computes (gem.models.sequence.PoolingByAttention; None: by its rule).
        row_bias: biases on the projections of every event row (self-attention's Q/K/V and output,
            the personalized FFN's output).
    """

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        streams: list[tuple[str, int, int, int | None]],
        skip: bool,
        num_summary: int,
        pffn_kv: int,
        pffn_activation: str,
        num_seeds: int,
        num_pooled: int,
        wukong: dict,
        backend: str | None = None,
        pool_rows: bool | None = None,
        row_bias: bool = True,
    ) -> None:
        super().__init__()
        self.skip = skip
        if not skip:
            self.x_summary = NonSequenceSummary(num_tokens, num_summary, dim)
            self.pffn = nn.ModuleDict(
                {
                    name: PersonalizedFFN(
                        width, heads, dim, num_summary, pffn_kv, pffn_activation, backend, bias=row_bias
                    )
                    for name, width, heads, _ in streams
                }
            )
            self.pool = nn.ModuleDict(
                {
                    name: SeedPooling(width, heads, dim, num_seeds, num_pooled, backend, pool_rows)
                    for name, width, heads, _ in streams
                }
            )
        self.attention = nn.ModuleDict(
            {
                name: JaggedSelfAttention(width, heads, window, backend, bias=row_bias)
                for name, width, heads, window in streams
            }
        )
        self.interaction = WukongLayer(num_tokens + num_pooled * len(streams), num_tokens, dim, **wukong)

    def forward(
        self,
        x: torch.Tensor,
        seqs: dict[str, JaggedEmbeddings],
        cached: list[torch.Tensor] | None,
        rope: dict[str, tuple] | None = None,
    ) -> tuple[torch.Tensor, dict[str, JaggedEmbeddings], list[torch.Tensor]]:
        """Returns the new tokens, the new streams and the pooled summaries (to be reused by a skip
        layer). ``rope``: per stream, its rotary tables (gem.models.sequence.rotary_tables); None:
        computed here."""
        rope = rope or {}
        if self.skip and cached is None:
            raise ValueError("model.compskip: the first Kunlun layer cannot be a skip layer")
        x_sum = None if self.skip else self.x_summary(x)
        out, pooled = {}, []
        for name, s in seqs.items():
            values = s.values if self.skip else self.pffn[name](s.values, s.offsets, s.max_len, x_sum)
            s = JaggedEmbeddings(
                self.attention[name](values, s.offsets, s.max_len, rope.get(name)), s.offsets, s.max_len
            )
            out[name] = s
            if not self.skip:
                pooled.append(self.pool[name](s))
        pooled = cached if self.skip else pooled
        return self.interaction(torch.cat([x, *pooled], dim=1)), out, pooled

    def flops(self, batch_size: int, lengths: dict[str, torch.Tensor], max_lens: dict[str, int], padded: bool) -> int:
        total = self.interaction.flops(batch_size)
        if not self.skip:
            total += self.x_summary.flops(batch_size)
        for name, n in lengths.items():
            total += self.attention[name].flops(n, max_lens[name], padded)
            if not self.skip:
                total += self.pffn[name].flops(n, max_lens[name], padded) + self.pool[name].flops(
                    n, max_lens[name], padded
                )
        return total
