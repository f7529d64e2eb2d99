"""Public sequential-recommendation data -> the gem Parquet layout, with the leave-one-out protocol.

Sources:

- the S3-Rec format (``<Name>.txt``: ``user item item ...`` in time order, ids from 1;
  ``<Name>_item2attributes.json``: ``{item: [attribute, ...]}``; optionally
  ``<Name>_sample.txt``: ``user neg ... neg``, the 99 evaluation negatives of each user);
- MovieLens-style interaction tables (``user, item, rating, timestamp``; ``::``, comma or tab
  separated, header optional), ordered by time per user.

Protocol (as in the S3-Rec paper): per user, the last item is the test target, the second
last the validation target, the rest train. Training rows: every prefix ``s[:t]`` of the
training part predicts ``s[t]`` (t >= 1), one positive row plus ``num_negatives`` rows with
items the user never touched. Evaluation rows: the true item and 99 negatives per user, all
with the user's id as ``request_id``, so gem's RankingEvaluator ranks them together. With
``refit`` the training part also holds the validation target (no validation split): the model to
test once the recipe is chosen.

The schema (one place: :func:`seqrec_schema`)::

    user_id    [1]            id feature, the user
    item_id    [1]            id feature, the candidate item (table "item")
    item_attr  [<= max_attrs] id feature, the candidate's attributes (when the source has them)
    hist_item  [<= max_len]   sequence group "hist": the items before the target, oldest first (table "item")
    dense      [1]            log(1 + history length)
    label_next_item           1 for the true next item, 0 for a negative
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gem.data.errors import DataError
from gem.data.format.dataset import make_once
from gem.data.format.layout import write_parquet
from gem.data.pipeline.schema import FeatureSchema

if TYPE_CHECKING:  # imported where a source is opened: the loader is heavy
    from gem.data.sources.base import DataSource

logger = logging.getLogger("gem")

CONVERTER_VERSION = 4
TASK = "next_item"
OBJECTIVES = ("pointwise", "generative")


@dataclass(frozen=True)
class SeqRecOptions:
    """``data.seqrec`` in config.

    Attributes:
        objective: ``pointwise``: a training row per (history prefix, candidate), the positive and
            ``num_negatives`` sampled ones, labelled; ``generative``: one training row per user, its
            whole training sequence (the most recent ``max_len`` events; every event predicts the
            next) and ``num_negatives`` items it never touched in ``neg_item`` (gem.models.generative).
        max_len: history events kept (the most recent), as SASRec's 50.
        train_windows: generative: a training sequence longer than ``max_len`` becomes several rows,
            windows of ``max_len`` events that overlap by one, so that every training event is a
            target once (false: only the most recent ``max_len`` events train, as SASRec).
        num_negatives: sampled negatives per training positive (generative: per user).
        event_attrs: attribute features per history event (``hist_attr0`` ...: the event's item's
            first attributes, 0 where it has fewer); 0: none.
        max_targets_per_user: keep only each user's most recent training targets (0 = all).
        num_eval_negatives: negatives per evaluation target (99 in the paper).
        max_eval_users: evaluate a seeded sample of this many users (0 = all).
        max_attrs: attributes kept per item (first ones, deduplicated).
        seed: training negatives; ``eval_seed`` (12345 as in the paper) the evaluation negatives.
        users_per_file: rows of this many users per Parquet file.
        refit: the training part runs through the validation target, which is then no longer held
            out (no ``val`` split is written): the final model for the test split, trained on every
            event before it once the recipe is chosen on validation.
        drop_last: leave each user's last ``drop_last`` events out before the split (users left with
            under 3 are dropped; evaluation negatives are still drawn against the whole history). With
            1, the test split is the validation target of the full data, with the same negatives: how
            ``refit`` changes a model's ranking of it can be measured without the test split.
    """

    objective: str = "pointwise"
    max_len: int = 50
    train_windows: bool = False
    num_negatives: int = 4
    max_targets_per_user: int = 0
    num_eval_negatives: int = 99
    max_eval_users: int = 0
    max_attrs: int = 8
    seed: int = 0
    eval_seed: int = 12345
    users_per_file: int = 2000
    event_attrs: int = 0
    refit: bool = False
    drop_last: int = 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> SeqRecOptions:
        try:
            options = cls(**dict(cfg or {}))
        except TypeError as e:
            raise ValueError(f"data.seqrec: {e}; known keys: {list(cls.__dataclass_fields__)}") from None
        if options.objective not in OBJECTIVES:
            raise ValueError(f"data.seqrec.objective={options.objective!r} is not one of {list(OBJECTIVES)}")
        if options.train_windows and (options.objective != "generative" or options.max_len < 2):
            raise ValueError(
                "data.seqrec.train_windows needs objective=generative and max_len >= 2 "
                f"(got {options.objective!r}, {options.max_len}); the pointwise rows already cover every target"
            )
        if options.objective == "generative" and options.num_negatives < 1:
            raise ValueError("data.seqrec.num_negatives must be >= 1 for the generative objective")
        if options.drop_last < 0:
            raise ValueError(f"data.seqrec.drop_last={options.drop_last}: the events to leave out must be >= 0")
        return options


@dataclass
class SeqRecData:
    """Users' item sequences (time order, item ids from 1) and optional side data."""

    sequences: list[np.ndarray]  # user u (0-based here; written as u + 1) -> items
    num_items: int
    attributes: dict[int, list[int]] | None = None  # item -> attribute ids (from 1)
    eval_negatives: dict[int, np.ndarray] | None = None  # user (0-based) -> fixed negatives


def seqrec_schema(
    num_users: int,
    num_items: int,
    num_attributes: int,
    max_attrs: int,
    max_len: int,
    event_attrs: int = 0,
    num_generative_negatives: int = 0,
) -> FeatureSchema:
    """The one place the seqrec schema is made: candidate, attributes and history share the item id space.

    ``event_attrs`` adds per-event attribute features to the history group; ``num_generative_negatives``
    the group ``neg`` (``neg_item``, also table ``item``, and ``neg_attr<i>`` like ``hist_attr<i>``)
    that holds a generative training row's negatives.
    """
    id_features = [
        {"name": "user_id", "cardinality": num_users + 1},
        {"name": "item_id", "cardinality": num_items + 1, "table": "item"},
    ]
    event_attrs = event_attrs if num_attributes else 0
    if num_attributes:  # with per-event attributes, the candidate's share their table
        id_features.append(
            {
                "name": "item_attr",
                "cardinality": num_attributes + 1,
                "max_ids": max_attrs,
                **({"table": "attr"} if event_attrs else {}),
            }
        )
    hist = [{"name": "hist_item", "cardinality": num_items + 1, "table": "item"}]
    hist += [{"name": f"hist_attr{i}", "cardinality": num_attributes + 1, "table": "attr"} for i in range(event_attrs)]
    groups = [{"name": "hist", "max_len": max_len, "features": hist}]
    if num_generative_negatives:  # the negatives carry the attributes the history's events carry
        neg = [{"name": "neg_item", "cardinality": num_items + 1, "table": "item"}]
        neg += [
            {"name": f"neg_attr{i}", "cardinality": num_attributes + 1, "table": "attr"} for i in range(event_attrs)
        ]
        groups.append({"name": "neg", "max_len": num_generative_negatives, "features": neg})
    return FeatureSchema.from_config(
        {
            "id_features": id_features,
            "sequence_groups": groups,
            "num_dense": 1,
            "tasks": [TASK],
            "num_domains": 1,
        }
    )


# -- readers -----------------------------------------------------------------------------------
def read_s3rec(directory: str | Path, name: str) -> SeqRecData:
    """Read ``<name>.txt`` (+ ``_item2attributes.json``, ``_sample.txt`` when present) from ``directory``."""
    directory = Path(directory)
    path = directory / f"{name}.txt"
    if not path.is_file():
        found = (
            sorted(p.stem for p in directory.glob("*.txt") if not p.stem.endswith("_sample"))
            if directory.is_dir()
            else []
        )
        raise FileNotFoundError(f"{path} not found; set data.dir to the folder and data.name to one of {found}")
    sequences, users = [], []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            ids = np.array(parts, dtype=np.int64)
        except ValueError:
            raise ValueError(
                f"{path}, line {line_no}: expected 'user item item ...' as integers, got {line[:80]!r}"
            ) from None
        if (ids[1:] < 1).any():
            raise ValueError(f"{path}, line {line_no}: item ids start at 1, found {int(ids[1:].min())}")
        users.append(int(ids[0]))
        sequences.append(ids[1:])
    if users != list(range(1, len(users) + 1)):
        raise ValueError(f"{path}: users must be numbered 1, 2, ... in line order (the S3-Rec format)")
    num_items = int(max(int(s.max()) for s in sequences if len(s)))
    data = SeqRecData(sequences, num_items)

    attr_path = directory / f"{name}_item2attributes.json"
    if attr_path.is_file():
        raw = json.loads(attr_path.read_text())
        data.attributes = {int(k): [int(a) for a in v] for k, v in raw.items()}
        data.num_items = max(num_items, max(data.attributes, default=0))
    sample_path = directory / f"{name}_sample.txt"
    if sample_path.is_file():
        negatives = {}
        for line in sample_path.read_text().splitlines():
            parts = np.array(line.split(), dtype=np.int64)
            if len(parts):
                negatives[int(parts[0]) - 1] = parts[1:]
        data.eval_negatives = negatives
    return data


def read_interactions(path: str | Path, min_rating: float = 0.0) -> SeqRecData:
    """Read a MovieLens-style table (user, item, rating, timestamp); ids are remapped to 1..N.

    Rows with ``rating < min_rating`` are dropped; each user's items are ordered by timestamp
    (ties keep file order).
    """
    path = Path(path)
    text = path.read_bytes()
    first = text.split(b"\n", 1)[0]
    if b"::" in first:
        text, delimiter = text.replace(b"::", b"\t"), "\t"
    else:
        delimiter = "\t" if b"\t" in first else ","
    head = first.replace(b"::", b"\t").split(delimiter.encode())
    has_header = not head[0].strip().lstrip(b"-").isdigit()
    try:
        table = pacsv.read_csv(
            io.BytesIO(text),
            read_options=pacsv.ReadOptions(autogenerate_column_names=not has_header),
            parse_options=pacsv.ParseOptions(delimiter=delimiter),
        )
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: not a user, item, rating, timestamp table ({e})") from None
    if table.num_columns < 4:
        raise ValueError(f"{path}: needs 4 columns (user, item, rating, timestamp), found {table.num_columns}")
    user, item, rating, stamp = (np.asarray(table.column(i).to_numpy(zero_copy_only=False)) for i in range(4))
    keep = rating.astype(np.float64) >= min_rating
    user, item, stamp = user[keep], item[keep], stamp[keep].astype(np.int64)
    user_ids, user_idx = np.unique(user, return_inverse=True)
    item_ids, item_idx = np.unique(item, return_inverse=True)
    order = np.lexsort((np.arange(len(user_idx)), stamp, user_idx))
    user_idx, item_idx = user_idx[order], item_idx[order] + 1
    bounds = np.concatenate([[0], np.cumsum(np.bincount(user_idx, minlength=len(user_ids)))])
    sequences = [item_idx[bounds[u] : bounds[u + 1]] for u in range(len(user_ids))]
    return SeqRecData(sequences, len(item_ids))


# -- examples ----------------------------------------------------------------------------------
def _gather_ranges(flat: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets ``[R+1]`` and values of ``flat[starts[r]:ends[r]]`` for every r, without a Python loop."""
    lengths = ends - starts
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    idx = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return offsets, flat[idx]


class _Seen:
    """Membership of (user, item) pairs, for sampling negatives the user never interacted with."""

    def __init__(self, sequences: list[np.ndarray], num_items: int) -> None:
        self.span = num_items + 1
        users = np.repeat(np.arange(len(sequences)), [len(s) for s in sequences])
        self.keys = np.unique(users * self.span + np.concatenate(sequences))

    def sample(self, rng: np.random.Generator, users: np.ndarray, k: int) -> np.ndarray:
        """``[len(users), k]`` items from 1..num_items, none seen by its user (with replacement)."""
        out = rng.integers(1, self.span, size=(len(users), k))
        for _ in range(100):
            keys = users[:, None] * self.span + out
            pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
            bad = self.keys[pos] == keys
            if not bad.any():
                return out
            out[bad] = rng.integers(1, self.span, size=int(bad.sum()))
        raise ValueError("could not sample unseen negatives: some user has interacted with almost every item")


def _table(
    attrs: tuple[np.ndarray, np.ndarray] | None,
    schema: FeatureSchema,
    flat: np.ndarray,
    starts: np.ndarray,
    users: np.ndarray,
    ends: np.ndarray,
    items: np.ndarray,
    labels: np.ndarray,
    request_id: np.ndarray,
    max_len: int,
    max_attrs: int,
    event_attrs: list[np.ndarray] = (),
    negatives: np.ndarray | None = None,
) -> pa.Table:
    """Rows: user ``users[r]`` (0-based), history ``s[:ends[r]]`` (most recent max_len), candidate ``items[r]``.

    ``event_attrs[i]`` maps an item to its i-th attribute (0: none) for ``hist_attr<i>``;
    ``negatives [R, K]`` fills ``neg_item`` (and ``neg_attr<i>``) where the schema has the group ``neg``
    (else empty lists)."""
    hist_start = starts[users] + np.maximum(0, ends - max_len)
    offsets, hist = _gather_ranges(flat, hist_start, starts[users] + ends)
    num_rows = len(users)
    ones = np.arange(num_rows + 1)
    columns = {
        "user_id": pa.ListArray.from_arrays(ones, users + 1),
        "item_id": pa.ListArray.from_arrays(ones, items.astype(np.int64)),
        "hist_item": pa.ListArray.from_arrays(offsets, hist.astype(np.int64)),
        **{f"hist_attr{i}": pa.ListArray.from_arrays(offsets, slot[hist]) for i, slot in enumerate(event_attrs)},
        "dense": pa.ListArray.from_arrays(ones, np.log1p(np.diff(offsets)).astype(np.float32)),
        f"label_{TASK}": pa.array(labels.astype(np.float32)),
        f"label_mask_{TASK}": pa.array(np.ones(num_rows, dtype=bool)),
        "domain": pa.array(np.zeros(num_rows, dtype=np.int64)),
        "request_id": pa.array(request_id.astype(np.int64)),
    }
    if attrs is not None:
        attr_offsets, attr_values = attrs
        columns["item_attr"] = pa.ListArray.from_arrays(
            *_gather_ranges(attr_values, attr_offsets[items], attr_offsets[items + 1])
        )
    if "neg" in {g.name for g in schema.sequence_groups}:
        k = 0 if negatives is None else negatives.shape[1]
        values = np.zeros(0, np.int64) if negatives is None else negatives.reshape(-1).astype(np.int64)
        columns["neg_item"] = pa.ListArray.from_arrays(np.arange(num_rows + 1) * k, values)
        for i, slot in enumerate(event_attrs):
            columns[f"neg_attr{i}"] = pa.ListArray.from_arrays(np.arange(num_rows + 1) * k, slot[values])
    return pa.table(columns)


def write_seqrec(data: SeqRecData, out_dir: str | Path, options: SeqRecOptions = SeqRecOptions()) -> dict[str, Any]:
    """Write ``train/ val/ test/`` under ``out_dir`` (atomically) and return a summary (also ``conversion.json``)."""
    o = options
    out_dir = Path(out_dir)
    full_lengths = np.array([len(s) for s in data.sequences])
    lengths = full_lengths - o.drop_last  # the events the split sees, oldest first
    kept = np.flatnonzero(lengths >= 3)  # a train item, a validation and a test target
    if not len(kept):
        raise ValueError(
            f"no user has 3 or more interactions (after data.seqrec.drop_last={o.drop_last}); the leave-one-out "
            "split needs them"
        )
    flat = np.concatenate(data.sequences).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(full_lengths)[:-1]])
    train_len = lengths - (1 if o.refit else 2)  # events in each user's training part
    num_attributes, attrs = 0, None
    if data.attributes:
        num_attributes = max((max(v) for v in data.attributes.values() if v), default=0)
        per_item = [list(dict.fromkeys(data.attributes.get(i, [])))[: o.max_attrs] for i in range(data.num_items + 1)]
        attrs = (
            np.concatenate([[0], np.cumsum([len(a) for a in per_item])]),
            np.array([a for v in per_item for a in v], dtype=np.int64),
        )
    generative = o.objective == "generative"
    schema = seqrec_schema(
        len(data.sequences),
        data.num_items,
        num_attributes,
        o.max_attrs,
        o.max_len,
        o.event_attrs,
        o.num_negatives if generative else 0,
    )
    event_attrs = []  # per slot i: item -> its i-th attribute (0: none)
    if num_attributes:
        event_attrs = [
            np.array([v[i] if len(v) > i else 0 for v in per_item], dtype=np.int64) for i in range(o.event_attrs)
        ]

    def table(*args, **kwargs):
        return _table(
            attrs,
            schema,
            flat,
            starts,
            *args,
            max_len=o.max_len,
            max_attrs=o.max_attrs,
            event_attrs=event_attrs,
            **kwargs,
        )

    seen = _Seen(data.sequences, data.num_items)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {"train": 0, "val": 0, "test": 0}

    # Training: targets t = 1 .. n-3 of each user (refit: n-2), the most recent max_targets_per_user of them.
    rng = np.random.default_rng(o.seed)
    chunks = np.array_split(kept, max(1, -(-len(kept) // o.users_per_file)))
    for f, chunk in enumerate(chunks if generative else ()):  # a row per user: its training events
        users, ends = chunk, train_len[chunk]
        if o.train_windows:  # or per window of max_len events, max_len - 1 targets each, the latest first
            step = max(1, o.max_len - 1)
            windows = np.maximum(1, -(-(ends - 1) // step))
            users = np.repeat(chunk, windows)
            back = np.arange(windows.sum()) - np.repeat(np.cumsum(windows) - windows, windows)
            ends = np.repeat(ends, windows) - step * back
        rows = table(
            users,
            ends,
            flat[starts[users] + ends - 1],
            np.ones(len(users)),
            users + 1,
            negatives=seen.sample(rng, users, o.num_negatives),
        )
        write_parquet(rows, tmp / "train" / f"part-{f:05d}.parquet", schema)
        counts["train"] += rows.num_rows
    for f, chunk in enumerate(() if generative else chunks):
        first = np.maximum(1, train_len[chunk] - (o.max_targets_per_user or 1 << 40))
        num_targets = np.maximum(0, train_len[chunk] - first)
        users = np.repeat(chunk, num_targets)
        ends = np.repeat(first - np.concatenate([[0], np.cumsum(num_targets)[:-1]]), num_targets) + np.arange(
            num_targets.sum()
        )
        positives = flat[starts[users] + ends]
        negatives = seen.sample(rng, users, o.num_negatives)
        k = 1 + o.num_negatives
        items = np.concatenate([positives[:, None], negatives], axis=1).reshape(-1)
        labels = np.tile(np.r_[1.0, np.zeros(o.num_negatives)], len(users))
        request = np.repeat(counts["train"] // k + np.arange(len(users)), k)
        rows = table(np.repeat(users, k), np.repeat(ends, k), items, labels, request)
        write_parquet(rows, tmp / "train" / f"part-{f:05d}.parquet", schema)
        counts["train"] += rows.num_rows

    # Evaluation: the true item + num_eval_negatives per user; the same negatives for val and test.
    eval_users = kept
    if o.max_eval_users and len(kept) > o.max_eval_users:
        eval_users = np.sort(np.random.default_rng(o.eval_seed).choice(kept, o.max_eval_users, replace=False))
    eval_rng = np.random.default_rng(o.eval_seed)
    for f, chunk in enumerate(np.array_split(eval_users, max(1, -(-len(eval_users) // o.users_per_file)))):
        negatives = _eval_negatives(data, seen, eval_rng, chunk, o.num_eval_negatives)
        k = 1 + negatives.shape[1]
        for split, back in (("test", 1),) if o.refit else (("val", 2), ("test", 1)):
            ends = lengths[chunk] - back
            items = np.concatenate([flat[starts[chunk] + ends][:, None], negatives], axis=1).reshape(-1)
            labels = np.tile(np.r_[1.0, np.zeros(k - 1)], len(chunk))
            rows = table(np.repeat(chunk, k), np.repeat(ends, k), items, labels, np.repeat(chunk + 1, k))
            write_parquet(rows, tmp / split / f"part-{f:05d}.parquet", schema)
            counts[split] += rows.num_rows
    summary = {
        "converter_version": CONVERTER_VERSION,
        "options": asdict(o),
        "rows": counts,
        "users": len(data.sequences),
        "users_kept": int(len(kept)),
        "eval_users": int(len(eval_users)),
        "items": data.num_items,
        "attributes": num_attributes,
        "fixed_eval_negatives": data.eval_negatives is not None,
        "schema": schema.to_config(),
        **_coverage(data, kept, lengths, train_len, starts, flat),
    }
    (tmp / "conversion.json").write_text(json.dumps(summary, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return summary


def _coverage(
    data: SeqRecData, kept: np.ndarray, lengths: np.ndarray, train_len: np.ndarray, starts: np.ndarray, flat: np.ndarray
) -> dict:
    """What the split leaves out or cannot learn, counted (the converter's log and ``conversion.json``):
    users with fewer than 3 events (dropped), item ids that never occur (gaps in the id range; their
    rows are never trained), items only ever seen as a validation or test target (cold: trained only
    as negatives), and items the attribute file does not list."""
    train = np.zeros(data.num_items + 1, dtype=bool)
    train_items = _gather_ranges(flat, starts[kept], starts[kept] + train_len[kept])[1]
    train[train_items] = True
    seen = np.zeros(data.num_items + 1, dtype=bool)
    seen[flat] = True
    return {
        "users_dropped_under_3_events": int(len(lengths) - len(kept)),
        "item_ids_never_seen": int((~seen[1:]).sum()),
        "items_only_in_evaluation": int((seen & ~train)[1:].sum()),
        "items_without_attributes": (
            int(sum(1 for i in range(1, data.num_items + 1) if not data.attributes.get(i))) if data.attributes else None
        ),
    }


def _eval_negatives(data: SeqRecData, seen: _Seen, rng: np.random.Generator, users: np.ndarray, k: int) -> np.ndarray:
    if data.eval_negatives is None:
        return seen.sample(rng, users, k)
    missing = [int(u) + 1 for u in users if int(u) not in data.eval_negatives]
    if missing:
        raise ValueError(f"the negatives file lacks users {missing[:5]}...; delete it to sample negatives instead")
    rows = [data.eval_negatives[int(u)] for u in users]
    if any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("the negatives file has lines of different lengths; every user needs the same number")
    return np.stack(rows)


def item_cooccurrence(
    files: list[Path], num_items: int, item_feature: str = "hist_item", user_feature: str = "user_id"
) -> tuple[np.ndarray, np.ndarray]:
    """The item-item cosine of co-occurrence over the users of a training split, ``S[i, j] =
    users(i, j) / sqrt(users(i) users(j))`` for ``i != j``, as sorted keys ``i * num_items + j``
    (int64) and their values (float32); pairs no user holds are absent.

    A user's items are those of ``item_feature`` in any of its rows (``user_feature``), each once
    (generative rows: one per user, or its windows with ``train_windows``; pointwise rows, prefixes,
    leave each user's last training event out). Work and memory go with the sum over users of their
    distinct items squared: meant for sequential-recommendation sets, not for an ads catalogue."""
    users, items = [], []
    for f in files:
        missing = {user_feature, item_feature} - set(pq.read_schema(f).names)
        if missing:
            raise DataError(
                f"{f}: model.cooccurrence counts the items of each user's rows, but the file has no column "
                f"{sorted(missing)}; use a seqrec data set (data=seqrec) or set model.cooccurrence=0"
            )
        table = pq.read_table(f, columns=[user_feature, item_feature])
        hist = table.column(item_feature).combine_chunks()
        user = table.column(user_feature).combine_chunks().flatten().to_numpy()
        lengths = np.diff(hist.offsets.to_numpy())
        users.append(np.repeat(user, lengths))
        items.append(hist.flatten().to_numpy())
    pairs = np.unique(np.concatenate(users).astype(np.int64) * num_items + np.concatenate(items))
    user, item = np.divmod(pairs, num_items)  # sorted by user: each user's distinct items in one run
    start = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    size = np.diff(np.r_[start, len(user)])
    # every ordered pair of a user's items: each (user, item) with every item of its user's run
    per = np.repeat(size, size)  # the pairs of each (user, item): its run's size
    first = np.repeat(start, size)  # where its run starts
    within = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)  # 0 .. size - 1 in each one's pairs
    left = np.repeat(item, per)
    right = item[np.repeat(first, per) + within]
    keys, counts = np.unique(left * num_items + right, return_counts=True)
    off = keys // num_items != keys % num_items
    keys, counts = keys[off], counts[off]
    holders = np.bincount(item, minlength=num_items).astype(np.float64)
    values = counts / np.sqrt(holders[keys // num_items] * holders[keys % num_items])
    return keys, values.astype(np.float32)


def prepare_seqrec(
    source: str | Path,
    name: str,
    cache_dir: str | Path,
    options: Mapping[str, Any] | None = None,
    is_writer: bool = True,
) -> Path:
    """Convert ``source/<name>.txt`` (S3-Rec) or the interaction table ``source/<name>`` (MovieLens-style:
    ``.dat``, ``.csv``, ``.tsv``) once into ``cache_dir``; return the gem data set folder.

    The folder's name hashes the source files' sizes and times and the options, so a changed
    source or option converts again. Only ``is_writer`` converts; the other ranks wait for it, and
    runs that share ``cache_dir`` (a sweep's, in parallel) convert it once.
    """
    o = SeqRecOptions.from_config(options)
    source = Path(source)
    candidates = [
        source / f"{name}.txt",
        source / f"{name}_item2attributes.json",
        source / f"{name}_sample.txt",
        source / name,
    ]
    present = [p for p in candidates if p.is_file()]
    if not present:
        raise FileNotFoundError(f"no {name}.txt (S3-Rec) or {name} (interaction table) in data.dir={str(source)!r}")
    key = json.dumps(
        {
            "v": CONVERTER_VERSION,
            "o": asdict(o),
            "files": [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in present],
        },
        sort_keys=True,
    )
    out = Path(cache_dir) / f"seqrec-{name.replace('.', '_')}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def convert() -> None:
        start = time.perf_counter()
        data = read_s3rec(source, name) if (source / f"{name}.txt").is_file() else read_interactions(source / name)
        summary = write_seqrec(data, out, o)
        logger.info(
            "converted %s/%s -> %s in %.1fs: %s rows; %d users dropped (under 3 events), %d item ids never "
            "seen, %d items only in evaluation, %s",
            source,
            name,
            out,
            time.perf_counter() - start,
            summary["rows"],
            summary["users_dropped_under_3_events"],
            summary["item_ids_never_seen"],
            summary["items_only_in_evaluation"],
            "no attributes file"
            if summary["items_without_attributes"] is None
            else f"{summary['items_without_attributes']} items without attributes",
        )

    return make_once(out, convert, is_writer, 1800, "convert")


def open_source(data_cfg: Any, is_writer: bool = True) -> DataSource:
    """``data.dir/<data.name>.txt`` (S3-Rec) or an interaction table, converted once into
    ``data.cache_dir`` (rank 0 converts; the other ranks wait)."""
    from gem.data.sources.base import DataSource

    d = data_cfg
    if not d.dir:
        raise ValueError("data.dir is required when data.kind=seqrec; set data.dir=/folder/with/<data.name>.txt")
    return DataSource.from_folder(d, prepare_seqrec(d.dir, d.name, d.cache_dir, d.seqrec, is_writer=is_writer))
