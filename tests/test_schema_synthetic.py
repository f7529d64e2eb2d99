import numpy as np
import pytest

from gem.data.pipeline.schema import FeatureSchema
from gem.data.sources.synthetic import SyntheticConfig, generate
from tests.conftest import TINY_SCHEMA


def test_schema_lookups(tiny_schema):
    assert tiny_schema.id_feature_names == ["user_id", "ad_id", "ad_cluster", "user_interests"]
    assert tiny_schema.sequence_feature_names == ["hist_item", "hist_action", "hist_surface", "hist_gap"]
    assert tiny_schema.cardinality("hist_gap") == 6 and tiny_schema.num_tasks == 2
    assert FeatureSchema.from_config(tiny_schema.to_config()) == tiny_schema
    with pytest.raises(KeyError, match="unknown feature 'nope'"):
        tiny_schema.cardinality("nope")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["id_features"].append({"name": "hist_item", "cardinality": 3}), "unique.*hist_item"),
        (lambda c: c["id_features"][0].update(cardinality=0), "user_id: cardinality"),
        (lambda c: c["sequence_groups"][0].update(max_len=0), "hist: needs max_len"),
        (lambda c: c.update(tasks=[]), "data.schema.tasks"),
        (lambda c: c["id_features"][0].update(name="user-id"), "identifier"),
        (lambda c: c.pop("num_dense"), "malformed"),
    ],
)
def test_schema_rejects_bad_config(edit, match):
    import copy

    cfg = copy.deepcopy(TINY_SCHEMA)
    edit(cfg)
    with pytest.raises(ValueError, match=match):
        FeatureSchema.from_config(cfg)


def test_generator_is_seeded_and_shaped(tiny_schema):
    a = generate(tiny_schema, 500, seed=1)
    b = generate(tiny_schema, 500, seed=1)
    c = generate(tiny_schema, 500, seed=2)
    assert a.equals(b) and not a.equals(c)
    lengths = a["hist_item"].combine_chunks().value_lengths().to_numpy()
    assert lengths.max() <= 12 and (lengths == 0).any(), "lengths capped at max_len, some histories empty"
    for f in ("hist_action", "hist_surface", "hist_gap"):
        assert np.array_equal(a[f].combine_chunks().value_lengths().to_numpy(), lengths)
    for name in tiny_schema.id_feature_names + tiny_schema.sequence_feature_names:
        ids = a[name].combine_chunks().flatten().to_numpy()
        assert ids.min() >= 0 and ids.max() < tiny_schema.cardinality(name)
    click = a["label_click"].to_numpy()
    conversion = a["label_conversion"].to_numpy()
    assert np.array_equal(a["label_mask_conversion"].to_numpy(), click > 0), "conversion observed only after a click"
    assert (conversion <= click).all() and 0 < click.mean() < 1 and conversion.sum() > 0


def test_generator_has_power_law_popularity_and_a_signal(tiny_schema):
    t = generate(tiny_schema, 4000, seed=5, cfg=SyntheticConfig(num_clusters=5, in_cluster_rate=0.0))
    counts = np.sort(np.bincount(t["hist_item"].combine_chunks().flatten().to_numpy(), minlength=80))[::-1]
    assert counts[:8].sum() > 3 * counts[-40:].sum(), "Zipf: a few items dominate"
    # The hidden signal: ads from the user's home cluster (ad_cluster == first interest), which also
    # fills most of the history, are clicked more.
    t = generate(tiny_schema, 4000, seed=5, cfg=SyntheticConfig(num_clusters=5))
    home = (
        t["user_interests"]
        .combine_chunks()
        .flatten()
        .to_numpy()[t["user_interests"].combine_chunks().offsets.to_numpy()[:-1]]
    )
    same = t["ad_cluster"].combine_chunks().flatten().to_numpy() == home
    click = t["label_click"].to_numpy()
    assert click[same].mean() > click[~same].mean() + 0.1


def test_generator_rejects_schema_without_roles(tiny_schema):
    import copy

    cfg = copy.deepcopy(TINY_SCHEMA)
    cfg["id_features"] = [f for f in cfg["id_features"] if f["name"] != "ad_id"]
    with pytest.raises(ValueError, match="missing.*ad_id"):
        generate(FeatureSchema.from_config(cfg), 10, seed=0)
