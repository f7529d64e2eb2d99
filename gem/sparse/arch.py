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

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.pipeline.schema import FeatureSchema
from gem.sparse.ids import IdMapper, build_id_spaces
from gem.sparse.tables import TableSpec, build_tables
from kernels.jagged import jagged_sum, lengths_to_offsets


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


# Pytree nodes, so that module hooks that look for tensors in outputs find the ones inside. FSDP2
# registers each block's pre-backward all-gather on the tensors of its output; torch 2.11's
# FSDP2 found them with tree_flatten, saw JaggedEmbeddings as an opaque leaf, and a layer's
# backward through its sequence output met freed parameters (gem_base on an H200). torch 2.13
# also walks dataclasses.
torch.export.register_dataclass(JaggedEmbeddings)
torch.export.register_dataclass(SparseOutput)


class SparseArch(nn.Module):
    """Embedding lookups for every id feature and sequence feature of ``schema``.

    Args:
        schema: the feature schema.
        tables: table specs (gem.sparse.tables.build_tables).
        backend: "torchrec" or "native".
        device: where to build the tables; "meta" defers allocation (TorchRec sharding or
            ``to_empty`` + ``init_weights`` materialize them).
        ids: ``sparse.ids`` (table -> raw id space and mapping, gem/sparse/ids.py): those tables'
            raw ids are mapped to rows before the lookups, by ``self.ids`` (an IdMapper, or None).
        ids_device: where the mapping state lives when ``device`` is "meta" (default: the CPU).

    ``forward(sparse, sequences, max_seq_len) -> SparseOutput``: id features are sum-pooled to
    ``[B, D_f]``; each sequence group's per-event embeddings are concatenated per event into
    ``JaggedEmbeddings``. An id feature whose table it shares with a sequence feature is looked
    up through the EmbeddingCollection and sum-pooled here.
    """

    def __init__(
        self,
        schema: FeatureSchema,
        tables: list[TableSpec],
        backend: str = "torchrec",
        device: torch.device | str | None = None,
        ids: dict | None = None,
        ids_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if backend not in ("torchrec", "native"):
            raise ValueError(f"sparse.backend must be 'torchrec' or 'native', got {backend!r}")
        self.schema = schema
        self.backend = backend
        self.tables = tables
        pooled = [t for t in tables if t.pooled]
        per_row = [t for t in tables if not t.pooled]
        self._table_of = {f: t for t in tables for f in t.feature_names}
        self._bag_features = [f for f in schema.id_feature_names if self._table_of[f].pooled]
        # id features whose table is shared with a sequence feature: looked up through the EC
        self.routed_id_features = [f for f in schema.id_feature_names if not self._table_of[f].pooled]
        if backend == "torchrec":
            from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

            device = torch.device(device) if device is not None else None
            self.ebc = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(**_torchrec_args(t)) for t in pooled], device=device
            )
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(**_torchrec_args(t)) for t in per_row], device=device)
        else:
            self.ebc = _NativeTables("embedding_bags", pooled, device)
            self.ec = _NativeTables("embeddings", per_row, device)
        meta = device is not None and torch.device(device).type == "meta"
        self.ids = IdMapper(build_id_spaces(tables, ids), ids_device if meta else device) if ids else None

    @classmethod
    def from_config(
        cls,
        schema: FeatureSchema,
        embedding_dim: int,
        init_scale: float = 0.05,
        dims: dict[str, int] | None = None,
        backend: str = "torchrec",
        device: torch.device | str | None = None,
        ids: dict | None = None,
        ids_device: torch.device | str | None = None,
    ) -> SparseArch:
        return cls(schema, build_tables(schema, embedding_dim, init_scale, dims), backend, device, ids, ids_device)

    def pooled_dim(self, feature: str) -> int:
        return self._table_of[feature].embedding_dim

    def sequence_dim(self, group: str) -> int:
        return sum(self._table_of[f].embedding_dim for f in self.schema.group(group).feature_names)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Uniform in ``[-init_scale, init_scale]``, as TorchRec initializes the same tables."""
        for t in self.tables:
            self.table_weight(t.name).uniform_(-t.init_scale, t.init_scale)

    def table_weight(self, name: str) -> torch.Tensor:
        spec = next(t for t in self.tables if t.name == name)
        return (self.ebc.embedding_bags if spec.pooled else self.ec.embeddings)[name].weight

    def forward(
        self, sparse: KeyedJaggedTensor, sequences: KeyedJaggedTensor, max_seq_len: dict[str, int]
    ) -> SparseOutput:
        if self.ids is not None:  # raw ids -> rows (sparse.ids)
            sparse, sequences = self.ids(sparse, sequences)
        if self.backend == "torchrec":
            pooled, per_event = self._torchrec_lookup(sparse, sequences)
        else:
            pooled, per_event = self._native_lookup(sparse, sequences)
        out = {}
        for g in self.schema.sequence_groups:
            parts = [per_event[f][0] for f in g.feature_names]
            offsets = per_event[g.feature_names[0]][1]
            out[g.name] = JaggedEmbeddings(
                torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], offsets, max_seq_len[g.name]
            )
        return SparseOutput(pooled=pooled, sequences=out)

    def _torchrec_lookup(self, sparse: KeyedJaggedTensor, sequences: KeyedJaggedTensor):
        bags, rows = sparse, sequences
        if self.routed_id_features:  # split the id features between the two collections
            by_key = sparse.to_dict()
            bags = KeyedJaggedTensor.from_jt_dict({f: by_key[f] for f in self._bag_features})
            routed = KeyedJaggedTensor.from_jt_dict({f: by_key[f] for f in self.routed_id_features})
            rows = KeyedJaggedTensor.concat([sequences, routed]) if self.schema.sequence_groups else routed
        pooled = self.ebc(bags).to_dict() if self._bag_features else {}
        per_event = {}
        if self.ec_features:  # indexed by name, not iterated: TorchRec's pipelines FX-trace this forward
            jagged = self.ec(rows)
            per_event = {f: (jagged[f].values(), _offsets(jagged[f])) for f in self.ec_features}
        for f in self.routed_id_features:
            pooled[f] = jagged_sum(*per_event.pop(f))
        return {f: pooled[f] for f in self.schema.id_feature_names}, per_event

    def _native_lookup(self, sparse: KeyedJaggedTensor, sequences: KeyedJaggedTensor):
        pooled, per_event = {}, {}
        for f, jt in sparse.to_dict().items() if self.schema.id_features else ():
            weight = self.table_weight(self._table_of[f].name)
            pooled[f] = F.embedding_bag(jt.values(), weight, _offsets(jt), mode="sum", include_last_offset=True)
        for f, jt in sequences.to_dict().items() if self.schema.sequence_groups else ():
            per_event[f] = (F.embedding(jt.values(), self.table_weight(self._table_of[f].name)), _offsets(jt))
        return pooled, per_event

    @property
    def ec_features(self) -> list[str]:
        return self.schema.sequence_feature_names + self.routed_id_features


def _offsets(jt) -> torch.Tensor:
    """int64 offsets of a JaggedTensor: FBGEMM's ``asynchronous_complete_cumsum`` where it has a
    kernel for the lengths' device, plain torch where it has none (the CPU build of fbgemm-gpu on
    CUDA tensors)."""
    lengths = jt.lengths()
    if fbgemm_has_kernels(lengths.device.type):
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))
    return lengths_to_offsets(lengths)


@functools.cache
def fbgemm_has_kernels(device_type: str) -> bool:
    """Whether the loaded fbgemm-gpu has kernels for ``device_type`` (its CPU build has none for CUDA)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
            "fbgemm::asynchronous_complete_cumsum", key
        )
    except RuntimeError:  # the op is not registered (no fbgemm_gpu loaded)
        return False


def _torchrec_args(t: TableSpec) -> dict:
    return dict(
        name=t.name,
        num_embeddings=t.num_embeddings,
        embedding_dim=t.embedding_dim,
        feature_names=list(t.feature_names),
        weight_init_min=-t.init_scale,
        weight_init_max=t.init_scale,
    )


class _NativeTables(nn.Module):
    """Plain-torch embedding tables, named like TorchRec's (``<attr>.<table>.weight``)."""

    def __init__(self, attr: str, tables: list[TableSpec], device) -> None:
        super().__init__()
        setattr(self, attr, nn.ModuleDict({t.name: _Weight(t.num_embeddings, t.embedding_dim, device) for t in tables}))


class _Weight(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device))
