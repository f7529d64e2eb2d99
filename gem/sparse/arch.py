"""SparseArch: the batch's KeyedJaggedTensors -> pooled embeddings and jagged sequence embeddings.

Two backends give the same numbers for the same weights:

- ``torchrec``: ``EmbeddingBagCollection`` (pooled id features) and ``EmbeddingCollection``
  (sequence features). This is the module TorchRec shards (gem/distributed/sharding.py).
- ``native``: plain ``torch.nn.functional.embedding_bag`` / ``embedding`` over the same
  tables, for machines where TorchRec's kernels cannot run. Its parameters carry TorchRec's
  names (``ebc.embedding_bags.<table>.weight``, ``ec.embeddings.<table>.weight``), so state
  dicts move between backends unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.schema import FeatureSchema
from gem.sparse.tables import TableSpec, build_tables


@dataclass
class JaggedEmbeddings:
    """Embeddings of one event stream: ``values [T, D]``, ``offsets [B+1]`` int64, host-side ``max_len``.

    ``D`` is the sum of the group's per-event feature dims (features concatenated per event).
    """

    values: torch.Tensor
    offsets: torch.Tensor
    max_len: int


@dataclass
class SparseOutput:
    pooled: dict[str, torch.Tensor]  # id feature -> [B, D_f]
    sequences: dict[str, JaggedEmbeddings]  # sequence group -> jagged embeddings


class SparseArch(nn.Module):
    """Embedding lookups for every id feature and sequence feature of ``schema``.

    Args:
        schema: the feature schema.
        tables: table specs (gem.sparse.tables.build_tables).
        backend: "torchrec" or "native".
        device: where to build the tables; "meta" defers allocation (TorchRec sharding or
            ``to_empty`` + ``init_weights`` materialize them).
    """

    def __init__(self, schema: FeatureSchema, tables: list[TableSpec], backend: str = "torchrec",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if backend not in ("torchrec", "native"):
            raise ValueError(f"sparse.backend must be 'torchrec' or 'native', got {backend!r}")
        self.schema = schema
        self.backend = backend
        self.tables = tables
        pooled = [t for t in tables if t.pooled]
        sequence = [t for t in tables if not t.pooled]
        if backend == "torchrec":
            from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

            self.ebc = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                           feature_names=list(t.feature_names), weight_init_min=-t.init_scale,
                                           weight_init_max=t.init_scale) for t in pooled],
                device=torch.device(device) if device is not None else None,
            )
            self.ec = EmbeddingCollection(
                tables=[EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                        feature_names=list(t.feature_names), weight_init_min=-t.init_scale,
                                        weight_init_max=t.init_scale) for t in sequence],
                device=torch.device(device) if device is not None else None,
            )
        else:
            self.ebc = _NativeTables("embedding_bags", pooled, device)
            self.ec = _NativeTables("embeddings", sequence, device)
        self._feature_dim = {f: t.embedding_dim for t in tables for f in t.feature_names}

    @classmethod
    def from_config(cls, schema: FeatureSchema, embedding_dim: int, init_scale: float = 0.05,
                    dims: dict[str, int] | None = None, backend: str = "torchrec",
                    device: torch.device | str | None = None) -> "SparseArch":
        return cls(schema, build_tables(schema, embedding_dim, init_scale, dims), backend, device)

    def pooled_dim(self, feature: str) -> int:
        return self._feature_dim[feature]

    def sequence_dim(self, group: str) -> int:
        return sum(self._feature_dim[f] for f in self.schema.group(group).feature_names)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Uniform in ``[-init_scale, init_scale]``, as TorchRec initializes the same tables."""
        for t in self.tables:
            self.table_weight(t.name).uniform_(-t.init_scale, t.init_scale)

    def table_weight(self, name: str) -> torch.Tensor:
        spec = next(t for t in self.tables if t.name == name)
        return (self.ebc.embedding_bags if spec.pooled else self.ec.embeddings)[name].weight

    def forward(self, sparse: KeyedJaggedTensor, sequences: KeyedJaggedTensor, max_seq_len: dict[str, int]) -> SparseOutput:
        if self.backend == "torchrec":
            pooled = self.ebc(sparse).to_dict() if self.schema.id_features else {}
            # Indexed by the schema's names, not iterated: TorchRec's pipelines FX-trace this forward.
            per_event = {}
            if self.schema.sequence_groups:
                jagged = self.ec(sequences)
                per_event = {f: (jagged[f].values(), jagged[f].offsets()) for f in self.schema.sequence_feature_names}
        else:
            pooled = self.ebc.pooled(sparse) if self.schema.id_features else {}
            per_event = self.ec.per_event(sequences) if self.schema.sequence_groups else {}
        out = {}
        for g in self.schema.sequence_groups:
            parts = [per_event[f][0] for f in g.feature_names]
            offsets = per_event[g.feature_names[0]][1].to(torch.int64)
            out[g.name] = JaggedEmbeddings(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], offsets, max_seq_len[g.name])
        return SparseOutput(pooled=pooled, sequences=out)


class _NativeTables(nn.Module):
    """Plain-torch embedding tables, named like TorchRec's (``<attr>.<table>.weight``)."""

    def __init__(self, attr: str, tables: list[TableSpec], device) -> None:
        super().__init__()
        self.attr = attr
        setattr(self, attr, nn.ModuleDict({t.name: _Weight(t.num_embeddings, t.embedding_dim, device) for t in tables}))
        self._feature_table = {f: t.name for t in tables for f in t.feature_names}

    def _lookup(self) -> nn.ModuleDict:
        return getattr(self, self.attr)

    def pooled(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = {}
        for feature, jt in kjt.to_dict().items():
            weight = self._lookup()[self._feature_table[feature]].weight
            out[feature] = F.embedding_bag(jt.values(), weight, jt.offsets(), mode="sum", include_last_offset=True)
        return out

    def per_event(self, kjt: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for feature, jt in kjt.to_dict().items():
            weight = self._lookup()[self._feature_table[feature]].weight
            out[feature] = (F.embedding(jt.values(), weight), jt.offsets())
        return out


class _Weight(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device))
