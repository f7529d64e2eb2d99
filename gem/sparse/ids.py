"""Unbounded ids: raw ids from a space larger than a table, mapped to its rows (``sparse.ids``).

Per table, one policy (docs/streaming.md, "Unbounded ids"):

- ``mch``: TorchRec's ``MCHManagedCollisionModule``, a sorted table of admitted raw ids and their
  rows, with LRU or LFU eviction (or none: a full table admits no more ids). Every
  ``eviction_interval`` training steps the ids seen since the last admission compete for rows;
  an id not (yet) admitted is looked up in the table's last row,
  which no id owns.
- ``hash``: a fixed 64-bit mix (SplitMix64's finalizer) of the raw id, modulo the rows.
- ``modulo``: ``raw id % rows``, the naive baseline.

The mapper runs inside the SparseArch before the lookups, on the batch's raw ids::

    #            i = 0                 i = 1      <- batch
    # "user_id"  [8123377781203]       [17]       raw ids in [0, raw_space)
    #     -> mch [3]                   [4095]     rows in [0, cardinality); 4095: not admitted yet

In a multi-process run the ``mch`` state is replicated: every rank admits the ids of the global
batch (all-gathered from the ranks in training steps), so every rank holds the same map, the map
equals the one a single process builds from the same global batches, and a checkpoint loads at any
world size. TorchRec's row-wise sharded managed-collision modules, which split the map over the
ranks, are not used (docs/streaming.md says why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from gem.data.errors import DataError
from gem.sparse.tables import TableSpec

POLICIES = ("mch", "hash", "modulo")
EVICTIONS = ("lru", "lfu", "none")
_INT64_MAX = torch.iinfo(torch.int64).max


class IdOutOfRangeError(DataError):
    """A raw id outside its table's declared ``[0, raw_space)``: bad input data (a DataError, which
    ``python -m gem.train`` prints as one line); the message names the feature, the id, the space and
    the key that declares it."""


@dataclass(frozen=True)
class IdSpace:
    """How one table's raw ids become rows: ``sparse.ids.<table>`` joined with the table's spec."""

    table: str
    num_embeddings: int
    feature_names: tuple[str, ...]
    raw_space: int = 2**63
    policy: str = "mch"
    eviction: str = "lru"
    eviction_interval: int = 1


def build_id_spaces(tables: Sequence[TableSpec], ids: Mapping[str, Any]) -> list[IdSpace]:
    """One :class:`IdSpace` per entry of ``ids`` (``sparse.ids``: table name -> mapping, as a dataclass
    or a dict with the keys of ``gem.train.config.IdSpaceConfig``)."""
    by_name = {t.name: t for t in tables}
    spaces = []
    for table, entry in ids.items():
        if table not in by_name:
            raise ValueError(
                f"sparse.ids.{table}: unknown table; the tables are {sorted(by_name)} (t_<table> of data.schema)"
            )
        fields = dict(entry) if isinstance(entry, Mapping) else dict(vars(entry))
        spec = by_name[table]
        space = IdSpace(table, spec.num_embeddings, spec.feature_names, **fields)
        if space.policy not in POLICIES or space.eviction not in EVICTIONS:
            raise ValueError(
                f"sparse.ids.{table}: policy must be one of {list(POLICIES)} and eviction one of "
                f"{list(EVICTIONS)}, got {space.policy!r} / {space.eviction!r}"
            )
        if space.policy == "mch" and space.num_embeddings < 2:
            raise ValueError(
                f"sparse.ids.{table}.policy=mch needs a table of >= 2 rows (one is the shared row of "
                f"ids not admitted yet); raise the cardinality or use policy=hash"
            )
        spaces.append(space)
    return spaces


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def hash_ids(values: torch.Tensor, num_rows: int) -> torch.Tensor:
    """SplitMix64's finalizer of int64 ``values`` (wrapping arithmetic), modulo ``num_rows``: rows in
    ``[0, num_rows)``, the same on every device and run."""
    z = values.to(torch.int64) + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (z & _INT64_MAX) % num_rows


def check_ranges(
    values: Mapping[str, torch.Tensor], raw_space: Mapping[str, int], tables: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`IdOutOfRangeError` naming the first feature of ``values`` with an id outside its
    ``[0, raw_space[feature])`` (and its table, ``tables[feature]``, in the key to raise); one host
    sync for all of them."""
    outside = [
        ((v < 0) | (v >= raw_space[f]) if raw_space[f] < 2**63 else v < 0).any() for f, v in values.items() if v.numel()
    ]
    if not outside or not bool(torch.stack(outside).any()):
        return
    for f, v in values.items():
        bad = v[(v < 0) | (v >= raw_space[f])] if raw_space[f] < 2**63 else v[v < 0]
        if bad.numel():
            key = f"sparse.ids.{tables[f] if tables and f in tables else '<table>'}.raw_space"
            raise IdOutOfRangeError(
                f"feature {f!r}: id {int(bad[0])} is outside its declared raw space "
                f"[0, {raw_space[f]}) ({key}); fix the input, or raise {key}"
            )


def _no_eviction_policy():
    """MCH that admits new ids into empty rows only: a mapped id keeps its row for good, and once the
    table is full new ids share the last row (the "without eviction" baseline). Its ``counts`` buffer
    holds 1 for a row with an id, 0 for an empty one."""
    from torchrec.modules.mc_modules import LFU_EvictionPolicy

    class NoEviction(LFU_EvictionPolicy):
        def update_metadata_and_generate_eviction_scores(
            self,
            current_iter,
            mch_size,
            argsort_mapping,
            sorted_counts,
            matching_mask,
            matching_indices,
            mch_metadata,
            history_metadata,
        ):
            taken = mch_metadata["counts"]
            taken[mch_size - 1] = 1  # the shared row of unadmitted ids is never handed out
            scores = torch.cat([taken * _INT64_MAX, sorted_counts[~matching_mask]])  # new ids: by frequency
            evicted, selected = self._compute_selected_eviction_and_replacement_indices(mch_size, scores)
            taken[evicted] = 1
            return evicted, selected

    return NoEviction()


def _mch_module(space: IdSpace, device: torch.device):
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy, MCHManagedCollisionModule

    policy = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy, "none": _no_eviction_policy}[space.eviction]()
    return MCHManagedCollisionModule(
        zch_size=space.num_embeddings,
        device=device,
        eviction_policy=policy,
        eviction_interval=space.eviction_interval,
        input_hash_size=min(space.raw_space, _INT64_MAX),
        name=space.table,
    )


def _reserve_history(mc, incoming: int) -> None:
    """Room for ``incoming`` more ids in MCH's history of the ids seen since the last admission.

    TorchRec sizes that buffer once, from the first batch (times ``eviction_interval`` times 1.25), and
    silently leaves out of the next admission the ids of later, larger batches (histories vary in
    length) that do not fit; an empty first batch would leave no room at all. This grows it instead,
    keeping what it holds."""
    size, offset = mc._input_history_buffer_size, mc._current_history_buffer_offset
    need = offset + incoming
    if size != -1 and need <= size:
        return
    kept = mc._history_accumulator[:offset].clone() if size != -1 else None
    kept_metadata = {k: v[:offset].clone() for k, v in mc._history_metadata.items()}
    per_step = max(incoming, -(-need // mc._eviction_interval), 1)  # TorchRec allots interval x 1.25 x this
    mc._init_history_buffers(
        {
            "ids": JaggedTensor(
                values=torch.empty(per_step, dtype=torch.int64, device=mc.device),
                lengths=torch.ones(per_step, dtype=torch.int64, device=mc.device),
            )
        }
    )
    if kept is not None:
        mc._history_accumulator[:offset] = kept
        for k, v in kept_metadata.items():
            mc._history_metadata[k][:offset] = v


def _all_gather(values: torch.Tensor) -> torch.Tensor:
    """The concatenated ``values`` of every rank, in rank order (sizes may differ)."""
    world = dist.get_world_size()
    size = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


class IdMapper(nn.Module):
    """Maps the raw ids of the ``spaces``' tables to rows, in both of the batch's KJTs.

    Args:
        spaces: one per mapped table (:func:`build_id_spaces`); other tables' ids pass unchanged.
        device: where the ``mch`` state lives (the batch's device).

    ``forward(sparse, sequences) -> (sparse, sequences)`` with the mapped features' values replaced
    by rows. Its buffers (``mch.<table>._mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, the
    LRU / LFU counters, the iteration) are the mapping state that checkpoints carry.
    :meth:`pop_counts` returns the collision / eviction counts since the last call.
    """

    def __init__(self, spaces: Sequence[IdSpace], device: torch.device | str | None = None) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.spaces = {s.table: s for s in spaces}
        self._table_of = {f: s.table for s in spaces for f in s.feature_names}
        self.mch = nn.ModuleDict({s.table: _mch_module(s, device) for s in spaces if s.policy == "mch"})
        self._counts: dict[str, dict[str, int | torch.Tensor]] = {}

    def forward(self, sparse: KeyedJaggedTensor, sequences: KeyedJaggedTensor):
        parts = {}  # feature -> its raw values, from whichever KJT holds it
        for kjt in (sparse, sequences):
            if kjt.keys():
                parts.update(
                    {k: v for k, v in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())) if k in self._table_of}
                )
        # every table first: a bad id changes no mapping state
        check_ranges(parts, {f: self.spaces[self._table_of[f]].raw_space for f in parts}, self._table_of)
        rows = {}
        for table, space in self.spaces.items():
            names = [f for f in space.feature_names if f in parts]
            raw = torch.cat([parts[f] for f in names]) if names else sparse.values().new_zeros(0)
            mapped = self._map(space, raw)
            if self.training:  # counted per training step; evaluation batches do not add to them
                self._count(table, "collisions", _num_distinct(raw) - _num_distinct(mapped))
            rows.update(zip(names, mapped.split([parts[f].numel() for f in names])))
        return _replace_values(sparse, rows), _replace_values(sequences, rows)

    def _map(self, space: IdSpace, raw: torch.Tensor) -> torch.Tensor:
        if space.policy == "modulo":
            return raw % space.num_embeddings
        if space.policy == "hash":
            return hash_ids(raw, space.num_embeddings)
        mc = self.mch[space.table]
        if self.training:  # admit (and evict) from the global batch's ids, identically on every rank
            seen = _all_gather(raw) if dist.is_initialized() and dist.get_world_size() > 1 else raw
            before = self._occupied(mc)
            _reserve_history(mc, seen.numel())
            mc.profile({space.table: JaggedTensor(values=seen, lengths=seen.new_ones(seen.numel()))})
            admitted = mc.evict()  # the rows handed to new ids this step (None: no admission step)
            if admitted is not None:  # evicted = admitted into rows that held an id before
                self._count(space.table, "evictions", admitted.numel() - (self._occupied(mc) - before))
        return mc.remap({space.table: JaggedTensor(values=raw, lengths=raw.new_ones(raw.numel()))})[
            space.table
        ].values()

    @staticmethod
    def _occupied(mc) -> torch.Tensor:
        """Rows holding an admitted id (the empty ones hold the int64 max sentinel), as a 0-dim tensor."""
        return (mc._mch_sorted_raw_ids != _INT64_MAX).sum()

    def _count(self, table: str, name: str, n: int | torch.Tensor) -> None:
        """Add ``n`` to a count; tensors stay on their device until :meth:`pop_counts` reads them."""
        counts = self._counts.setdefault(table, {})
        counts[name] = counts.get(name, 0) + n

    def pop_counts(self) -> dict[str, float]:
        """``ids/<table>/collisions`` (raw ids that shared a row with another of the same batch, summed over
        the steps since the last call), and for ``mch`` ``ids/<table>/evictions`` and ``ids/<table>/occupied``
        (rows holding an admitted id now); then starts counting again."""
        out = {}
        for table, space in self.spaces.items():
            counts = self._counts.get(table, {})
            out[f"ids/{table}/collisions"] = float(counts.get("collisions", 0))
            if space.policy == "mch":
                out[f"ids/{table}/evictions"] = float(counts.get("evictions", 0))
                out[f"ids/{table}/occupied"] = float(self._occupied(self.mch[table]))
        self._counts = {}
        return out


def _num_distinct(values: torch.Tensor) -> torch.Tensor | int:
    """Distinct values, as a 0-dim tensor (no host sync, unlike ``unique().numel()``)."""
    if values.numel() == 0:
        return 0
    ordered = values.sort().values
    return (ordered[1:] != ordered[:-1]).sum() + 1


def _replace_values(kjt: KeyedJaggedTensor, rows: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
    """``kjt`` with the values of the keys in ``rows`` replaced (same lengths, same order)."""
    keys = kjt.keys()
    if not any(k in rows for k in keys):
        return kjt
    parts = kjt.values().split(kjt.length_per_key())
    values = torch.cat([rows.get(k, p) for k, p in zip(keys, parts)])
    return KeyedJaggedTensor(
        keys=keys, values=values, lengths=kjt.lengths(), weights=kjt.weights_or_none(), stride=kjt.stride()
    )
