"""A seeded generator of ads-like examples with a learnable hidden signal.

The world: items belong to ``num_clusters`` interest clusters and carry a latent vector near
their cluster's centre; each user has a home cluster. A user's history mixes items from the
home cluster with globally popular items (Zipf popularity); history lengths are lognormal,
capped at the group's ``max_len``, with a share of empty histories. The candidate ad is drawn
half from the user's cluster, half from the whole catalogue.

Labels: ``click ~ Bernoulli(sigmoid(a * <taste, v_ad> + <w, dense> + domain_bias + c))`` where
``taste`` is the mean latent vector of the history (the home cluster's centre when the history
is empty). ``conversion`` is observed only after a click (``label_mask``) with its own logit.
A model sees ids, not latents, so it must learn the item embeddings and the history-ad match.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gem.data.format.dataset import make_once
from gem.data.pipeline.schema import FeatureSchema

if TYPE_CHECKING:  # imported where a source is opened: the loader is heavy
    from gem.data.sources.base import DataSource

# The default synthetic schema's roles: these names must exist in a schema passed to generate().
ROLES = ("user_id", "ad_id", "ad_cluster", "user_interests", "hist_item", "hist_action", "hist_surface", "hist_gap")


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the generator (``data.synthetic`` in config)."""

    num_clusters: int = 20
    zipf_exponent: float = 1.1
    history_log_mean: float = 2.8  # lognormal length: exp(2.8) ~ 16 events median
    history_log_std: float = 1.0
    empty_history_rate: float = 0.05
    in_cluster_rate: float = 0.7
    signal_strength: float = 4.0
    latent_dim: int = 8
    # A later time of the same world (knowledge transfer: a teacher trained on drift 0, students on a
    # later period): each item's latent vector moves this far towards a second draw near its cluster's
    # centre, and the popularity ranking is partly reshuffled (the same share of ids). 0: none; 1: a new draw.
    drift: float = 0.0


def _zipf_sampler(rng: np.random.Generator, n: int, exponent: float):
    p = 1.0 / np.arange(1, n + 1) ** exponent
    p /= p.sum()
    perm = rng.permutation(n)  # popular ids are spread over the id space
    return lambda size: perm[rng.choice(n, size=size, p=p)]


def generate(
    schema: FeatureSchema, num_examples: int, seed: int, cfg: SyntheticConfig = SyntheticConfig(), world_seed: int = 0
) -> pa.Table:
    """Generate ``num_examples`` rows in the gem Parquet layout (columns of gem/data/format/layout.py).

    ``world_seed`` fixes the hidden world (latents, clusters, popularity) shared by all splits;
    ``seed`` draws this split's examples.
    """
    missing = [r for r in ROLES if r not in schema.id_feature_names + schema.sequence_feature_names]
    if missing:
        raise ValueError(f"data.schema: the synthetic generator needs the features {list(ROLES)}; missing {missing}")
    world = np.random.default_rng(world_seed)
    num_items = schema.cardinality("ad_id")
    if schema.cardinality("hist_item") != num_items:
        raise ValueError("data.schema: hist_item and ad_id must have the same cardinality (one item catalogue)")
    num_users = schema.cardinality("user_id")
    k = min(cfg.num_clusters, schema.cardinality("ad_cluster"), schema.cardinality("user_interests"))
    centres = world.normal(size=(k, cfg.latent_dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    item_cluster = world.integers(0, k, size=num_items)
    latents = centres[item_cluster] + 0.35 * world.normal(size=(num_items, cfg.latent_dim))
    later = np.random.default_rng([world_seed, 1])  # the drifted world: its own stream, the base world unchanged
    if cfg.drift:
        latents = (1 - cfg.drift) * latents + cfg.drift * (
            centres[item_cluster] + 0.35 * later.normal(size=(num_items, cfg.latent_dim))
        )
    user_cluster = world.integers(0, k, size=num_users)
    dense_w = world.normal(scale=0.5, size=(2, schema.num_dense))
    domain_bias = world.normal(scale=0.5, size=(2, schema.num_domains))
    popular = _zipf_sampler(world, num_items, cfg.zipf_exponent)
    if cfg.drift:
        base, moved = popular, later.random(num_items) < cfg.drift  # these ids swap popularity among themselves
        remap = np.arange(num_items)
        remap[moved] = later.permutation(np.flatnonzero(moved))
        popular = lambda size: remap[base(size)]  # noqa: E731
    members = [np.flatnonzero(item_cluster == c) for c in range(k)]

    rng = np.random.default_rng(seed)
    users = _zipf_sampler(rng, num_users, 0.8)(num_examples)
    home = user_cluster[users]
    max_len = schema.group(_group_of(schema, "hist_item")).max_len
    lengths = np.minimum(
        np.round(rng.lognormal(cfg.history_log_mean, cfg.history_log_std, num_examples)), max_len
    ).astype(np.int64)
    lengths[rng.random(num_examples) < cfg.empty_history_rate] = 0
    total = int(lengths.sum())
    owner = np.repeat(np.arange(num_examples), lengths)
    in_cluster = rng.random(total) < cfg.in_cluster_rate
    hist_item = popular(total)
    hist_item[in_cluster] = _draw_from(rng, members, home[owner[in_cluster]])
    ad = popular(num_examples)
    pick = rng.random(num_examples) < 0.5
    ad[pick] = _draw_from(rng, members, home[pick])

    taste = np.zeros((num_examples, cfg.latent_dim))
    np.add.at(taste, owner, latents[hist_item])
    taste = np.where(lengths[:, None] > 0, taste / np.maximum(lengths, 1)[:, None], centres[home])
    taste /= np.linalg.norm(taste, axis=1, keepdims=True) + 1e-6
    match = (taste * latents[ad]).sum(axis=1)
    dense = rng.normal(size=(num_examples, schema.num_dense)).astype(np.float32)
    domain = rng.integers(0, schema.num_domains, size=num_examples)
    click_logit = cfg.signal_strength * match + dense @ dense_w[0] + domain_bias[0, domain] - 2.5
    click = rng.random(num_examples) < _sigmoid(click_logit)
    conv_logit = 0.5 * cfg.signal_strength * match + dense @ dense_w[1] + domain_bias[1, domain] - 1.0
    conversion = click & (rng.random(num_examples) < _sigmoid(conv_logit))

    # Interests: up to max_ids clusters, the home cluster first, others random.
    max_interests = next(f.max_ids for f in schema.id_features if f.name == "user_interests")
    num_interests = rng.integers(1, max_interests + 1, size=num_examples)
    interests = (
        np.concatenate([[h] + list(rng.integers(0, k, size=n - 1)) for h, n in zip(home, num_interests)])
        if num_examples
        else np.zeros(0, np.int64)
    )

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pos_from_end = offsets[owner + 1] - np.arange(total) - 1
    columns = {
        "user_id": _lists(users[:, None]),
        "ad_id": _lists(ad[:, None]),
        "ad_cluster": _lists(item_cluster[ad][:, None]),
        "user_interests": pa.ListArray.from_arrays(
            np.concatenate([[0], np.cumsum(num_interests)]), interests.astype(np.int64)
        ),
        "hist_item": pa.ListArray.from_arrays(offsets, hist_item.astype(np.int64)),
        "hist_action": pa.ListArray.from_arrays(offsets, rng.integers(0, schema.cardinality("hist_action"), total)),
        "hist_surface": pa.ListArray.from_arrays(offsets, rng.integers(0, schema.cardinality("hist_surface"), total)),
        "hist_gap": pa.ListArray.from_arrays(
            offsets, np.minimum(np.log2(pos_from_end + 1).astype(np.int64), schema.cardinality("hist_gap") - 1)
        ),
        "dense": pa.ListArray.from_arrays(np.arange(num_examples + 1) * schema.num_dense, dense.reshape(-1)),
        "domain": pa.array(domain.astype(np.int64)),
    }
    extra = [n for n in schema.id_feature_names + schema.sequence_feature_names if n not in columns]
    for name in extra:  # features outside the roles carry noise ids (no signal)
        card = schema.cardinality(name)
        n = lengths if name in schema.sequence_feature_names else np.ones(num_examples, np.int64)
        columns[name] = pa.ListArray.from_arrays(
            np.concatenate([[0], np.cumsum(n)]), rng.integers(0, card, int(n.sum()))
        )
    labels = {"click": click, "conversion": conversion}
    observed = {"click": np.ones(num_examples, bool), "conversion": click}
    for task in schema.tasks:
        if task not in labels:
            raise ValueError(f"data.schema.tasks: the synthetic generator knows tasks {list(labels)}, not {task!r}")
        columns[f"label_{task}"] = pa.array(labels[task].astype(np.float32))
        columns[f"label_mask_{task}"] = pa.array(observed[task])
    return pa.table(columns)


def _group_of(schema: FeatureSchema, feature: str) -> str:
    return next(g.name for g in schema.sequence_groups if feature in g.feature_names)


def _draw_from(rng: np.random.Generator, members: list[np.ndarray], clusters: np.ndarray) -> np.ndarray:
    out = np.empty(len(clusters), np.int64)
    for c in np.unique(clusters):
        sel = clusters == c
        out[sel] = members[c][rng.integers(0, len(members[c]), int(sel.sum()))] if len(members[c]) else 0
    return out


def _lists(ids: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(np.arange(ids.shape[0] + 1) * ids.shape[1], ids.reshape(-1).astype(np.int64))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def write_dataset(
    directory,
    schema: FeatureSchema,
    num_examples: dict[str, int],
    seed: int,
    cfg: SyntheticConfig = SyntheticConfig(),
    rows_per_file: int = 50_000,
) -> None:
    """Write ``train/``, ``val/``, ``test/`` Parquet folders under ``directory``, atomically.

    The data set appears under its final name only once complete, so an interrupted run never
    leaves a half-written data set that a later run would trust.
    """
    import shutil

    from gem.data.format.layout import write_parquet

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for i, (split, n) in enumerate(num_examples.items()):
        # a drifted (later) period of the same world draws its own examples too
        table = generate(schema, n, seed=seed * 1000 + i + 1 + (500 if cfg.drift else 0), cfg=cfg, world_seed=seed)
        for j, start in enumerate(range(0, max(n, 1), rows_per_file)):
            write_parquet(table.slice(start, rows_per_file), tmp / split / f"part-{j:05d}.parquet", schema)
    tmp.rename(directory)


def synthetic_dir(
    cache_dir: str,
    name: str,
    schema: FeatureSchema,
    num_examples: Mapping[str, int],
    seed: int,
    knobs: Mapping[str, Any],
) -> Path:
    """The cache folder of a synthetic data set: its name plus a hash of everything that shapes it."""
    key = json.dumps(
        {"schema": schema.to_config(), "n": dict(num_examples), "seed": seed, "knobs": dict(knobs)}, sort_keys=True
    )
    return Path(cache_dir) / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def prepare_synthetic(
    cache_dir: str,
    name: str,
    schema: FeatureSchema,
    num_examples: Mapping[str, int],
    seed: int,
    knobs: Mapping[str, Any],
    is_writer: bool = True,
) -> Path:
    """Return the synthetic data set's folder, generating it first if absent.

    Only ``is_writer`` (rank 0) generates; other ranks wait for the folder to appear.
    """
    try:
        cfg = SyntheticConfig(**knobs)
    except TypeError as e:
        raise ValueError(f"data.synthetic: {e}; known knobs: {list(SyntheticConfig.__dataclass_fields__)}") from None
    directory = synthetic_dir(cache_dir, name, schema, num_examples, seed, knobs)
    make = functools.partial(write_dataset, directory, schema, dict(num_examples), seed, cfg)
    return make_once(directory, make, is_writer, 600, "generate")


def open_source(data_cfg: Any, is_writer: bool = True) -> DataSource:
    """``data.dir`` if set, else the generated data set in ``data.cache_dir`` (rank 0 writes it on
    first use; the other ranks wait for it)."""
    from gem.data.sources.base import DataSource

    if data_cfg.dir:
        return DataSource.from_folder(data_cfg, Path(data_cfg.dir))
    d = data_cfg
    directory = prepare_synthetic(
        d.cache_dir,
        d.name,
        FeatureSchema.from_config(d.schema),
        d.num_examples,
        d.seed,
        d.synthetic,
        is_writer=is_writer,
    )
    return DataSource.from_folder(d, directory)
