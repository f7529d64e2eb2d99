"""The GEM dense arch: non-sequence tokens and jagged event streams through a stack of
InterFormer or Kunlun layers, then multi-domain, multi-task heads.

Data flow (``block`` picks the layer type; every event stream has its own width / heads / window)::

    pooled id embeddings [B, D_f] ─ linear ─┐
    dense [B, num_dense] ─ MLP ─────────────┼─► X [B, F, d]   (F = id features + dense + domain)
    domain ─ embedding ─────────────────────┘
    each stream: jagged [T, D_g] ─ linear ─► S [T, D_s]   (InterFormer: N CLS tokens from X prepended)
                     │
          num_layers x InterFormerLayer | KunlunLayer   (Kunlun: CompSkip on alternate layers)
                     │
    [flat(X); flat(summary(S)) per stream] ─ top MLP ─► MultiDomainHeads ─► logits [B, num_tasks]

This is the ``dense_arch`` of :class:`gem.models.gem.GEMModel`: ``forward(sparse_output, dense,
domain)``; built on the meta device, then ``to_empty`` + :meth:`init_weights`.
:meth:`flops` gives the forward / backward FLOPs of a batch on its true jagged lengths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import Capabilities
from gem.models.heads import MultiDomainHeads
from gem.models.interformer import InterFormerLayer, NonSequenceSummary, SequenceSummary
from gem.models.kunlun import KunlunLayer, SeedPooling
from gem.models.layers import MLP, init_module_tree
from gem.models.sequence import linear_flops, rotary_tables
from gem.sparse.arch import JaggedEmbeddings, SparseOutput
from kernels.jagged import jagged_prepend, offsets_to_lengths

BLOCKS = ("interformer", "kunlun")


class GEMDenseArch(nn.Module):
    """Args:
    schema / feature_dims: the feature schema and the SparseArch's widths (passed by the trainer).
    block: ``"interformer"`` or ``"kunlun"``.
    dim: ``d``, width of the non-sequence tokens; num_layers: depth of the stack.
    num_heads / head_dim / window: default attention settings of every event stream;
        ``streams`` overrides them per stream, e.g. ``{"hist": {"num_heads": 4, "window": 32}}``.
    num_summary: ``N``, tokens of the non-sequence summary (InterFormer: also the CLS tokens).
    pffn_kv / pffn_activation: the personalized FFN (GDPA form) of both blocks.
    interaction / num_pma / num_recent: InterFormer's interaction ensemble and sequence summary.
    compskip / num_seeds / num_pooled / wukong: Kunlun's CompSkip, seed pooling and Wukong
        interaction (``rank``, ``hidden``, ``num_lcb``, ``num_experts``).
    top_mlp / tower_mlp / domain_mode: the shared MLP and the heads (``"gate"`` or ``"towers"``).
    attention_backend: ``kernels.jagged_attention`` backend (configs: ``${kernels.attention_backend}``).
    pool_rows: how PMA / seed pooling compute (gem.models.sequence.PoolingByAttention): None picks
        by the query count, True pools the rows unprojected, False projects them (same function).
    row_bias: biases on the projections of every event row in the layers (self-attention's Q/K/V and
        output, the personalized FFN's output); False drops them, as PaLM and LLaMA do, and with them
        a sum over every row of each one's gradient in the backward (the pre-norms' shifts remain).
    """

    def __init__(
        self,
        schema: FeatureSchema,
        feature_dims: dict[str, int],
        block: str = "interformer",
        dim: int = 32,
        num_layers: int = 2,
        num_heads: int = 2,
        head_dim: int = 16,
        window: int | None = None,
        streams: dict[str, dict[str, Any]] | None = None,
        num_summary: int = 2,
        pffn_kv: int = 8,
        pffn_activation: str = "silu",
        interaction: tuple[str, ...] = ("dot", "dcnv2"),
        num_pma: int = 2,
        num_recent: int = 2,
        compskip: bool = True,
        num_seeds: int = 8,
        num_pooled: int = 2,
        wukong: dict[str, Any] | None = None,
        top_mlp: tuple[int, ...] = (128, 64),
        tower_mlp: tuple[int, ...] = (),
        domain_mode: str = "gate",
        attention_backend: str | None = None,
        pool_rows: bool | None = None,
        row_bias: bool = True,
    ) -> None:
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"model.block={block!r} must be one of {list(BLOCKS)}")
        if pool_rows not in (None, True, False):
            raise ValueError(f"model.pool_rows={pool_rows!r} must be null (chosen by query count), true or false")
        if not isinstance(row_bias, bool):
            raise ValueError(f"model.row_bias={row_bias!r} must be true or false")
        if not schema.sequence_groups:
            raise ValueError("model: the GEM arch needs at least one sequence group in data.schema.sequence_groups")
        streams = dict(streams or {})
        unknown = sorted(set(streams) - {g.name for g in schema.sequence_groups})
        if unknown:
            raise ValueError(
                f"model.streams: unknown event streams {unknown}; the schema has "
                f"{[g.name for g in schema.sequence_groups]}"
            )
        self.schema, self.block, self.dim, self.num_summary = schema, block, dim, num_summary
        self.specs: list[tuple[str, int, int, int | None]] = []  # (name, width, heads, window)
        for g in schema.sequence_groups:
            s = {"num_heads": num_heads, "head_dim": head_dim, "window": window} | streams.get(g.name, {})
            extra = sorted(set(s) - {"num_heads", "head_dim", "window"})
            if extra:
                raise ValueError(f"model.streams.{g.name}: unknown keys {extra}; allowed: num_heads, head_dim, window")
            self.specs.append((g.name, int(s["num_heads"]) * int(s["head_dim"]), int(s["num_heads"]), s["window"]))

        self.id_proj = nn.ModuleDict({f: nn.Linear(feature_dims[f], dim) for f in schema.id_feature_names})
        self.bottom = MLP(schema.num_dense, (dim,)) if schema.num_dense else None
        self.domain_embedding = nn.Embedding(schema.num_domains, dim)
        self.num_tokens = len(schema.id_feature_names) + (1 if schema.num_dense else 0) + 1
        self.stream_proj = nn.ModuleDict(
            {name: nn.Linear(feature_dims[name], width) for name, width, _, _ in self.specs}
        )

        if block == "interformer":
            self.cls_summary = NonSequenceSummary(self.num_tokens, num_summary, dim)
            self.cls_proj = nn.ModuleDict({name: nn.Linear(dim, width) for name, width, _, _ in self.specs})
            self.layers = nn.ModuleList(
                InterFormerLayer(
                    self.num_tokens,
                    dim,
                    self.specs,
                    num_summary,
                    list(interaction),
                    pffn_kv,
                    pffn_activation,
                    num_pma,
                    num_recent,
                    attention_backend,
                    pool_rows,
                    row_bias,
                )
                for _ in range(num_layers)
            )
            self.final = nn.ModuleDict(
                {
                    name: SequenceSummary(
                        width, heads, dim, num_summary, num_pma, num_recent, attention_backend, pool_rows
                    )
                    for name, width, heads, _ in self.specs
                }
            )
        else:
            self.layers = nn.ModuleList(
                KunlunLayer(
                    self.num_tokens,
                    dim,
                    self.specs,
                    compskip and i % 2 == 1,
                    num_summary,
                    pffn_kv,
                    pffn_activation,
                    num_seeds,
                    num_pooled,
                    dict(wukong or {}),
                    attention_backend,
                    pool_rows,
                    row_bias,
                )
                for i in range(num_layers)
            )
            self.final = nn.ModuleDict(
                {
                    name: SeedPooling(width, heads, dim, num_seeds, num_pooled, attention_backend, pool_rows)
                    for name, width, heads, _ in self.specs
                }
            )
        rep_dim = dim * (self.num_tokens + sum(m.num_tokens for m in self.final.values()))
        self.top = MLP(rep_dim, tuple(top_mlp))
        self.heads = MultiDomainHeads(
            self.top.out_dim, schema.num_tasks, schema.num_domains, tuple(tower_mlp), domain_mode
        )
        self.capabilities = Capabilities(
            counts_flops=True, head_representation=True, sequence_summaries=len(self.final) > 0
        )

    def init_weights(self) -> None:
        """Initialize every parameter (after ``to_empty``); fails if a parameter has no rule."""
        init_module_tree(self)

    def forward(self, sparse: SparseOutput, dense: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        tokens = [self.id_proj[f](sparse.pooled[f]) for f in self.schema.id_feature_names]
        if self.bottom is not None:
            tokens.append(self.bottom(dense))
        tokens.append(self.domain_embedding(domain))
        x = torch.stack(tokens, dim=1)  # [B, F, d]
        seqs = {}
        for name, _, _, _ in self.specs:
            s = sparse.sequences[name]
            seqs[name] = JaggedEmbeddings(self.stream_proj[name](s.values), s.offsets, s.max_len)

        if self.block == "interformer":
            cls = self.cls_summary(x)  # [B, N, d]: target-aware CLS tokens (X holds the candidate)
            for name, s in seqs.items():
                values, offsets = jagged_prepend(self.cls_proj[name](cls), s.values, s.offsets)
                seqs[name] = JaggedEmbeddings(values, offsets, s.max_len + self.num_summary)
        # rotary tables once per stream, for every layer (positions do not change between layers)
        rope = {
            name: rotary_tables(seqs[name].offsets, seqs[name].values.shape[0], width // heads)
            for name, width, heads, _ in self.specs
        }
        if self.block == "interformer":
            for layer in self.layers:
                x, seqs = layer(x, seqs, rope)
        else:
            pooled = None
            for layer in self.layers:
                x, seqs, pooled = layer(x, seqs, pooled, rope)
        rep = [x.flatten(1)] + [self.final[name](s).flatten(1) for name, s in seqs.items()]
        return self.heads(self.top(torch.cat(rep, dim=1)), domain)

    def flops(
        self,
        batch_size: int,
        lengths: dict[str, torch.Tensor],
        max_lens: dict[str, int] | None = None,
        padded: bool = False,
    ) -> dict[str, int]:
        """Analytic FLOPs of one forward and one backward pass (matmuls only, as FlopCounterMode counts).

        Args:
            lengths: per event stream, the true history lengths ``[B]``.
            max_lens: per stream, the batch's ``max_len``; only used with ``padded``.
            padded: count attention as the reference backend computes it (every example padded
                to ``max_len``, masks applied afterwards), to check against FlopCounterMode; the
                default counts the visible pairs on the true jagged lengths, as the kernels do.

        Backward is twice the forward (an input and a weight gradient per matmul), less the input
        gradient of the dense bottom layer, whose input needs none.
        """
        lengths = {name: n.detach().long().cpu() for name, n in lengths.items()}
        max_lens = dict(max_lens or {name: int(n.max()) if n.numel() else 0 for name, n in lengths.items()})
        b = batch_size
        fwd = sum(linear_flops(b, m.in_features, m.out_features) for m in self.id_proj.values())
        first_bottom = 0
        if self.bottom is not None:
            first_bottom = linear_flops(b, self.schema.num_dense, self.dim)
            fwd += first_bottom
        for name, width, _, _ in self.specs:
            fwd += linear_flops(int(lengths[name].sum()), self.stream_proj[name].in_features, width)
        if self.block == "interformer":
            fwd += self.cls_summary.flops(b)
            fwd += sum(linear_flops(b * self.num_summary, self.dim, width) for _, width, _, _ in self.specs)
            lengths = {name: n + self.num_summary for name, n in lengths.items()}
            max_lens = {name: n + self.num_summary for name, n in max_lens.items()}
        fwd += sum(layer.flops(b, lengths, max_lens, padded) for layer in self.layers)
        fwd += sum(self.final[name].flops(lengths[name], max_lens[name], padded) for name in lengths)
        fwd += sum(linear_flops(b, m.in_features, m.out_features) for m in self.top.net if isinstance(m, nn.Linear))
        fwd += self.heads.flops(b)
        return {"forward": fwd, "backward": 2 * fwd - first_bottom}


def sequence_lengths(sparse: SparseOutput) -> dict[str, torch.Tensor]:
    """The true history length ``[B]`` of every event stream of a SparseOutput."""
    return {name: offsets_to_lengths(s.offsets) for name, s in sparse.sequences.items()}
