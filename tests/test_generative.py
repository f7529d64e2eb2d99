"""Generative next-event training (gem/models/generative.py) and its seqrec rows: the rows, the
sampled softmax against a loop, causality, and training through ``train(cfg)`` on both blocks and
on TorchRec-sharded tables."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch

from gem.data.errors import DataError
from gem.data.format.dataset import schema_from_files, split_files
from gem.data.pipeline.loader import build_loader
from gem.data.sources.seqrec import SeqRecOptions, item_cooccurrence, read_s3rec, write_seqrec
from gem.models.gem import GEMModel
from gem.models.generative import GenerativeSeqArch
from gem.sparse.arch import SparseArch
from gem.train.config import ConfigError, validate
from gem.train.trainer import train
from tests.conftest import compose, needs_fbgemm_cuda
from tests.test_checkpoint import _interrupt, _losses
from tests.test_seqrec import NUM_ITEMS, _rows, _write_s3rec

OPTIONS = SeqRecOptions(
    objective="generative", max_len=6, num_negatives=3, num_eval_negatives=9, event_attrs=2, users_per_file=7
)


@pytest.fixture
def generative_data(tmp_path):
    sequences = _write_s3rec(tmp_path)
    out = tmp_path / "out"
    write_seqrec(read_s3rec(tmp_path, "Tiny"), out, OPTIONS)
    return sequences, out


def test_generative_rows_hold_each_users_training_events_and_unseen_negatives(generative_data):
    sequences, out = generative_data
    schema = schema_from_files(split_files(out, "train"))
    assert schema.group("neg").max_len == 3 and schema.group("hist").feature_names == [
        "hist_item",
        "hist_attr0",
        "hist_attr1",
    ]
    rows = _rows(out, "train")
    assert len(rows) == 30
    for r in rows:
        seq = sequences[r["user_id"][0] - 1]
        assert r["hist_item"] == seq[:-2][-6:].tolist(), "the training part: all but the validation and test targets"
        assert r["hist_attr0"] == [1 + i % 5 for i in r["hist_item"]] and r["hist_attr1"] == [
            6 + i % 3 for i in r["hist_item"]
        ]
        assert len(r["neg_item"]) == 3 and not set(r["neg_item"]) & set(seq.tolist())
    for split in ("val", "test"):
        assert all(r["neg_item"] == [] for r in _rows(out, split))


def test_train_windows_make_every_training_event_a_target_once(tmp_path):
    """Users of 1 to 9 training events, windows of 6: a window holds 2 to 6 events (1 where that is all)."""
    sequences = _write_s3rec(tmp_path)
    out, plain = tmp_path / "windows", tmp_path / "plain"
    write_seqrec(read_s3rec(tmp_path, "Tiny"), out, dataclasses.replace(OPTIONS, train_windows=True))
    write_seqrec(read_s3rec(tmp_path, "Tiny"), plain, OPTIONS)
    rows = _rows(out, "train")
    targets = {}  # user -> the events predicted (every event of a row but its first)
    for r in rows:
        seq = sequences[r["user_id"][0] - 1][:-2].tolist()
        assert 2 <= len(r["hist_item"]) <= 6 or len(r["hist_item"]) == len(seq) == 1, r
        start = next(i for i in range(len(seq)) if seq[i : i + len(r["hist_item"])] == r["hist_item"])
        targets.setdefault(r["user_id"][0], []).extend(range(start + 1, start + len(r["hist_item"])))
        assert not set(r["neg_item"]) & set(sequences[r["user_id"][0] - 1].tolist())
    assert len(rows) > 30, "some users hold more than one window"
    for user, predicted in targets.items():
        assert sorted(predicted) == list(range(1, len(sequences[user - 1]) - 2)), user
    for split in ("val", "test"):  # evaluation is untouched
        assert _rows(out, split) == _rows(plain, split)
    with pytest.raises(ValueError, match="train_windows needs objective=generative"):
        SeqRecOptions.from_config({"train_windows": True})


def _model(schema, block="interformer", **kwargs):
    torch.manual_seed(0)
    sparse = SparseArch.from_config(schema, 16, backend="native")
    sparse.init_weights()
    dims = {f: sparse.pooled_dim(f) for f in schema.id_feature_names}
    dims |= {g.name: sparse.sequence_dim(g.name) for g in schema.sequence_groups}
    with torch.device("meta"):
        dense = GenerativeSeqArch(
            schema,
            dims,
            block=block,
            dim=8,
            num_heads=2,
            head_dim=8,
            pffn_kv=4,
            attention_backend="reference",
            **kwargs,
        )
    dense.to_empty(device="cpu")
    dense.init_weights()
    return GEMModel(sparse, dense)


def _tiny_seqrec_gen(tmp_path) -> list[str]:
    """``experiment=seqrec_gen`` on the tiny set that ``_write_s3rec`` wrote into ``tmp_path``, at a
    test's size (16 users a step, 20 evaluation negatives, no DataLoader workers, the epochs a test
    sets without the recipe's step floor)."""
    return [
        "experiment=seqrec_gen",
        "trainer.min_steps=0",
        f"data.dir={tmp_path}",
        "data.name=Tiny",
        "data.batch_size=16",
        "data.num_workers=0",
        "data.eval_batch_size=800",
        "data.seqrec.num_eval_negatives=20",
        "trainer.progress_bar=false",
    ]


def _batch(out, split="train", batch_size=8):
    schema = schema_from_files(split_files(out, split))
    options = {"balance": split == "train"}  # evaluation rows in file order, as the trainer reads them
    return schema, next(iter(build_loader(split_files(out, split), schema, batch_size, num_workers=0, options=options)))


@pytest.mark.parametrize(
    "in_batch, logq, smoothing, bias",
    [
        (1000, True, 0.0, False),
        (5, True, 0.0, False),
        (1000, False, 0.0, False),
        (5, True, 0.2, False),
        (5, True, 0.0, True),
    ],
)
def test_sampled_softmax_equals_a_loop_over_positions(generative_data, in_batch, logq, smoothing, bias):
    _, out = generative_data
    schema, batch = _batch(out)
    model = _model(schema, in_batch_negatives=in_batch, logq_correction=logq, label_smoothing=smoothing, item_bias=bias)
    arch = model.dense_arch
    seed = torch.random.get_rng_state()
    loss = model(batch)  # training mode: the loss

    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    h = arch.encode(sparse).detach().double()
    values = sparse.sequences["hist"].values.detach().double()[:, : arch.item_dim]
    negs = sparse.sequences["neg"].values.detach().double()[:, : arch.item_dim]
    ids = batch.sequences.to_dict()
    items, neg_ids = ids["hist_item"].values(), ids["neg_item"].values()
    offsets = sparse.sequences["hist"].offsets.tolist()
    rows = [(r, r + 1) for b in range(len(offsets) - 1) for r in range(offsets[b], offsets[b + 1] - 1)]
    total = values.shape[0]
    torch.random.set_rng_state(seed)
    arch.encode(sparse)  # the same random draws as the model's forward, up to the pool
    pool = torch.randint(0, total, (in_batch,)).tolist() if total > in_batch else list(range(total))
    has_next = {r for r, _ in rows}
    count = {}
    for _, t in rows:
        count[int(items[t])] = count.get(int(items[t]), 0) + 1
    cands = [
        (values[p + 1] if p + 1 < total else values[total - 1], int(items[min(p + 1, total - 1)]))
        for p in pool
        if p in has_next
    ]
    cands += [(negs[j], int(neg_ids[j])) for j in range(negs.shape[0])]
    num_items = schema.cardinality("hist_item")

    def log_q(item):
        return math.log(count.get(item, 0) * len(pool) / total + negs.shape[0] / (num_items - 1)) if logq else 0.0

    def cos(query, item):  # with item_bias, the item's last column is its bias logit
        vector, prior = (item[:-1], float(item[-1])) if bias else (item, 0.0)
        return float(query @ vector / (query.norm() * vector.norm())) / 0.05 + prior

    expected = []
    for r, t in rows:
        target = int(items[t])
        positive = cos(h[r], values[t]) - log_q(target)
        logits = [positive] + [cos(h[r], e) - log_q(i) for e, i in cands if i != target]
        lse = torch.logsumexp(torch.tensor(logits), 0).item()
        expected.append((1 - smoothing) * (lse - positive) + smoothing * (lse - sum(logits) / len(logits)))
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-4)


def _with_attributes(tmp_path, without=()):
    """The tiny set with one or two attributes per item (odd items: one; the items in ``without``:
    none), converted with an attribute bag as large as an event's."""
    _write_s3rec(tmp_path)
    attrs = {str(i): [1 + i % 5] if i % 2 else [1 + i % 5, 6 + i % 3] for i in range(1, NUM_ITEMS + 1)}
    for item in without:
        attrs.pop(item)
    (tmp_path / "Tiny_item2attributes.json").write_text(json.dumps(attrs))
    out = tmp_path / "out"
    write_seqrec(read_s3rec(tmp_path, "Tiny"), out, dataclasses.replace(OPTIONS, max_attrs=2))
    return out


def test_item_attributes_score_an_item_alike_in_training_and_ranking(tmp_path):
    """model.item_attributes: an item is its id row plus attr_proj(sum of its attribute rows), the
    same whether it is a negative in training (per-slot features, id 0 for a missing attribute) or
    a ranking row's candidate (the attribute bag)."""
    out = _with_attributes(tmp_path)
    schema, train_batch = _batch(out, batch_size=30)
    assert schema.group("neg").feature_names == ["neg_item", "neg_attr0", "neg_attr1"]
    model = _model(schema, item_attributes=True).eval()
    arch = model.dense_arch
    assert arch.sequence_ids == ("hist_item", "neg_item", "hist_attr0", "hist_attr1", "neg_attr0", "neg_attr1")
    sparse = model.sparse_arch(train_batch.sparse, train_batch.sequences, train_batch.max_seq_len)
    ids = {f: jt.values() for f, jt in train_batch.sequences.to_dict().items()}
    as_negative = arch.item_rows(sparse.sequences["neg"].values, ids, "neg")
    assert (ids["neg_attr1"] == 0).any() and (ids["neg_attr1"] != 0).any(), "both kinds of item among the negatives"
    _, eval_batch = _batch(out, "test", batch_size=300)
    pooled = model.sparse_arch(eval_batch.sparse, eval_batch.sequences, eval_batch.max_seq_len).pooled
    as_candidate = pooled["item_id"] + arch.attr_proj(pooled["item_attr"])
    candidate_ids = eval_batch.sparse["item_id"].values()
    matched = 0
    for row, item in enumerate(ids["neg_item"].tolist()):
        where = (candidate_ids == item).nonzero()
        if len(where):
            torch.testing.assert_close(as_negative[row], as_candidate[where[0, 0]])
            matched += 1
    assert matched > 10
    loss = model.train()(train_batch)
    loss.sum().backward()
    assert arch.attr_proj.weight.grad.abs().sum() > 0


def test_item_bias_adds_the_last_column_of_the_scored_item_in_ranking(tmp_path):
    """model.item_bias: a ranking row's logit is the cosine of the state after its history with
    the candidate's other columns, over the temperature, plus the candidate's last column (its id
    row's and its attributes' map's, summed)."""
    out = _with_attributes(tmp_path)
    schema, batch = _batch(out, "test", batch_size=300)
    model = _model(schema, item_attributes=True, item_bias=True).eval()
    arch = model.dense_arch
    assert arch.out.out_features == arch.item_dim - 1
    with torch.no_grad():
        arch.attr_proj.weight.normal_(std=10.0)  # a bias column far from zero
        logits = model(batch).squeeze(1)
        sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
        items = sparse.pooled["item_id"] + arch.attr_proj(sparse.pooled["item_attr"])
        states = arch.last_states(sparse)
    bias = items[:, -1]
    assert bias.abs().max() > 1.0
    cosine = torch.nn.functional.cosine_similarity(states, items[:, :-1], dim=1) / arch.temperature
    torch.testing.assert_close(logits, cosine + bias)


def test_the_attribute_loss_equals_a_loop_over_positions(tmp_path):
    out = _with_attributes(tmp_path, without=("4",))  # an item without attributes: its positions are left out
    schema, batch = _batch(out, batch_size=30)
    base = _model(schema, item_attributes=True)
    model = _model(schema, item_attributes=True, attribute_loss=0.5)  # the same weights, and an attribute head
    arch = model.dense_arch
    assert arch.attr_head.out_features == schema.cardinality("hist_attr0")
    loss = model(batch)

    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    log_p = torch.log_softmax(arch.attr_head(arch.encode(sparse)).double(), -1).detach()
    ids = {f: jt.values() for f, jt in batch.sequences.to_dict().items()}
    offsets = sparse.sequences["hist"].offsets.tolist()
    per_row = []
    for b in range(len(offsets) - 1):
        for r in range(offsets[b], offsets[b + 1] - 1):
            present = [int(ids[f][r + 1]) for f in ("hist_attr0", "hist_attr1") if int(ids[f][r + 1])]
            if present:
                per_row.append(-sum(float(log_p[r, a]) for a in present) / len(present))
    assert any(int(i) == 4 for i in ids["hist_item"]) and len(per_row) > 10
    assert loss.item() - base(batch).item() == pytest.approx(0.5 * sum(per_row) / len(per_row), rel=1e-4)
    loss.sum().backward()
    assert arch.attr_head.weight.grad.abs().sum() > 0


def test_ranking_encodes_each_users_history_once_with_the_same_scores(generative_data):
    """A user's 1 + 9 evaluation rows share one encoding of the history; the scores equal those of
    encoding every row."""
    from gem.models.generative import _distinct_runs
    from kernels.jagged import offsets_to_lengths

    _, out = generative_data
    schema, batch = _batch(out, "test", batch_size=100)
    model = _model(schema).eval()
    arch = model.dense_arch
    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    keep, inverse = _distinct_runs(sparse.sequences["hist"], [sparse.pooled["user_id"]])
    assert keep.numel() == 10 and inverse.tolist() == [i // 10 for i in range(100)]
    s = sparse.sequences["hist"]
    h = arch.encode(sparse)  # every row
    last = h[(s.offsets[1:] - 1).clamp_min(0)] * (offsets_to_lengths(s.offsets) > 0).unsqueeze(1)
    expected = arch._rows(last, sparse.pooled["item_id"])
    torch.testing.assert_close(model(batch).squeeze(1), expected, rtol=1e-5, atol=1e-5)


def test_item_attributes_need_the_bag_to_hold_what_an_event_carries(generative_data):
    _, out = generative_data  # max_attrs 8, event_attrs 2
    with pytest.raises(
        ValueError,
        match="holds up to 8 attributes but the events carry \\[2, 2\\]; set "
        "data.seqrec.max_attrs equal to data.seqrec.event_attrs",
    ):
        _model(schema_from_files(split_files(out, "train")), item_attributes=True)


def test_item_attributes_on_a_set_without_attributes_name_the_fix(tmp_path):
    _write_s3rec(tmp_path)
    (tmp_path / "Tiny_item2attributes.json").unlink()  # a folder with only <name>.txt
    write_seqrec(read_s3rec(tmp_path, "Tiny"), tmp_path / "out", OPTIONS)
    schema = schema_from_files(split_files(tmp_path / "out", "train"))
    with pytest.raises(ValueError, match="no 'item_attr' feature .* set model.item_attributes=false"):
        _model(schema, item_attributes=True)
    _model(schema, item_attributes=False)  # and without them it builds


def test_item_attributes_null_uses_them_when_the_data_has_them(tmp_path):
    """model.item_attributes=null (experiment=seqrec_gen's default): on a folder without
    <name>_item2attributes.json the attribute parts are off (and the attribute loss with them), said
    in one info line; on a folder with them the model is the one model.item_attributes=true builds."""
    _write_s3rec(tmp_path)
    options = dataclasses.replace(OPTIONS, max_attrs=2)
    write_seqrec(read_s3rec(tmp_path, "Tiny"), tmp_path / "with", options)
    (tmp_path / "Tiny_item2attributes.json").unlink()
    write_seqrec(read_s3rec(tmp_path, "Tiny"), tmp_path / "without", options)
    with_attrs, without = (schema_from_files(split_files(tmp_path / d, "train")) for d in ("with", "without"))

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # "gem" itself: the trainer's logging set-up stops it propagating to the root
    gem_logger, level = logging.getLogger("gem"), logging.getLogger("gem").level
    gem_logger.addHandler(handler)
    gem_logger.setLevel(logging.INFO)
    try:
        auto = _model(with_attrs, item_attributes=None, attribute_loss=0.5).dense_arch
        assert not records
        off = _model(without, item_attributes=None, attribute_loss=0.5).dense_arch
    finally:
        gem_logger.removeHandler(handler)
        gem_logger.setLevel(level)
    lines = [r for r in records if "item_attributes" in r.getMessage()]
    assert len(records) == len(lines) == 1 and lines[0].levelno == logging.INFO, records
    assert lines[0].getMessage() == (
        "model.item_attributes=null: the data has no 'item_attr' feature (no <name>_item2attributes.json): "
        "items are scored by their id rows alone; model.attribute_loss=0.5 is off with them"
    )
    assert off.attr_proj is None and off.attr_head is None and off.attribute_loss == 0 and not off.attr_slots

    explicit = _model(with_attrs, item_attributes=True, attribute_loss=0.5).dense_arch
    slots = {"hist": ["hist_attr0", "hist_attr1"], "neg": ["neg_attr0", "neg_attr1"]}
    assert auto.attr_slots == explicit.attr_slots == slots
    assert auto.attribute_loss == 0.5 and auto.attr_head is not None
    state, expected = auto.state_dict(), explicit.state_dict()
    assert list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in state)
    with pytest.raises(ValueError, match="no 'item_attr' feature .* set model.item_attributes=false"):
        _model(without, item_attributes=True)  # an explicit true still fails


def test_seqrec_gen_runs_on_a_folder_without_attributes(tmp_path):
    """experiment=seqrec_gen (and LastFM's attribute loss) on <name>.txt alone trains, with one info
    line in each stage's log; an explicit model.item_attributes=true stops with the fix named."""
    _write_s3rec(tmp_path, num_users=40)
    (tmp_path / "Tiny_item2attributes.json").unlink()
    run = [
        *_tiny_seqrec_gen(tmp_path),
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=2",
        "model.attribute_loss=0.5",
    ]
    result = train(compose([*run, f"trainer.run_dir={tmp_path / 'run'}"]))
    assert result["next_item/groups"] == 40 and 0 <= result["next_item/hr@10"] <= 1
    for stage in ("run/pretrain", "run"):  # the masked-item stage builds its own model
        log = (tmp_path / stage / "train.log").read_text()
        assert log.count("model.item_attributes=null") == 1, log
        assert "items are scored by their id rows alone; model.attribute_loss=0.5 is off with them" in log
    with pytest.raises(ConfigError, match="no 'item_attr' feature .* set model.item_attributes=false"):
        train(compose([*run, "model.item_attributes=true", f"trainer.run_dir={tmp_path / 'explicit'}"]))


@pytest.mark.parametrize("experiment", ["seqrec_gen_ids", "seqrec_gen_ids_lastfm"])
def test_the_id_only_variants_leave_the_attributes_out_where_a_folder_has_them(tmp_path, experiment):
    """experiment=seqrec_gen_ids (docs/seqrec.md, "On item ids alone"): the events carry their item
    alone, items are scored by their id rows, and the co-occurrence prior scores the ranking."""
    _write_s3rec(tmp_path, num_users=40)
    run = [
        f"experiment={experiment}",
        *_tiny_seqrec_gen(tmp_path)[1:],
        f"data.cache_dir={tmp_path / 'cache'}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.epochs=1",
        "trainer.pretrain=['model.objective=masked_item']",  # a stage of the run's one epoch
    ]
    config = validate(compose(run))
    assert not config.model["item_attributes"] and config.model["cooccurrence"] > 0
    result = train(compose(run))
    assert result["next_item/groups"] == 40
    (folder,) = (tmp_path / "cache").glob("seqrec-Tiny-*")
    assert schema_from_files(split_files(folder, "train")).group("hist").feature_names == ["hist_item"]


def test_seqrec_gen_on_a_folder_with_attributes_is_the_model_with_them(tmp_path):
    """The recipe's model.item_attributes=null on a folder with attributes trains bit-identically to
    model.item_attributes=true (the recipe's setting before null)."""
    _write_s3rec(tmp_path, num_users=40)
    run = [
        *_tiny_seqrec_gen(tmp_path),
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=2",
        "trainer.log_every=1",
        "trainer.pretrain=[]",
        "model.attribute_loss=0.5",
    ]
    results = {}
    for name, extra in (("auto", []), ("true", ["model.item_attributes=true"])):
        results[name] = train(compose([*run, *extra, f"trainer.run_dir={tmp_path / name}"]))
        assert "model.item_attributes=null" not in (tmp_path / name / "train.log").read_text()
    assert len(_losses(tmp_path / "auto")) == 4 and _losses(tmp_path / "auto") == _losses(tmp_path / "true")
    assert results["auto"] | {"train_seconds": 0} == results["true"] | {"train_seconds": 0}


@pytest.mark.parametrize("logq", [True, False])
def test_masked_item_loss_equals_a_loop_over_masked_positions(generative_data, logq):
    """model.objective=masked_item: each masked position scores its own item against every event's
    item (in-batch) and the sampled negatives, logQ-corrected, accidental hits left out."""
    _, out = generative_data
    schema, batch = _batch(out)
    model = _model(schema, objective="masked_item", mask_prob=0.3, logq_correction=logq, in_batch_negatives=1000)
    arch = model.dense_arch
    seed = torch.random.get_rng_state()
    loss = model(batch)

    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    values = sparse.sequences["hist"].values
    total = values.shape[0]
    torch.random.set_rng_state(seed)
    masked = torch.rand(total) < 0.3  # the model's draws, in its order
    masked[torch.randint(0, total, (1,))] = True
    h = arch.encode(sparse, masked).detach().double()
    items_emb = values.detach().double()[:, : arch.item_dim]
    negs = sparse.sequences["neg"].values.detach().double()[:, : arch.item_dim]
    ids = batch.sequences.to_dict()
    items, neg_ids = ids["hist_item"].values().tolist(), ids["neg_item"].values().tolist()
    count = {}
    for i in items:
        count[i] = count.get(i, 0) + 1
    num_items = schema.cardinality("hist_item")

    def log_q(item):
        return math.log(count.get(item, 0) + negs.shape[0] / (num_items - 1)) if logq else 0.0

    cands = [(items_emb[r], items[r]) for r in range(total)] + [(negs[j], neg_ids[j]) for j in range(len(neg_ids))]
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm())) / 0.05  # noqa: E731
    expected = []
    for r in torch.nonzero(masked).flatten().tolist():
        positive = cos(h[r], items_emb[r]) - log_q(items[r])
        logits = [positive] + [cos(h[r], e) - log_q(i) for e, i in cands if i != items[r]]
        expected.append(torch.logsumexp(torch.tensor(logits), 0).item() - positive)
    assert 0 < masked.sum() < total
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    loss.backward()
    assert arch.mask_row.weight.grad.abs().sum() > 0


def test_masked_positions_hide_their_event_and_attention_sees_both_ways(generative_data):
    _, out = generative_data
    schema, batch = _batch(out)
    model = _model(schema, objective="masked_item", num_layers=2).eval()
    assert not any(layer.attention.causal for layer in model.dense_arch.layers)
    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    s = sparse.sequences["hist"]
    first, last = int(s.offsets[0]), int(s.offsets[1]) - 1
    assert last > first, "the first example needs two events"
    masked = torch.zeros(s.values.shape[0], dtype=torch.bool)
    masked[first] = True
    h = model.dense_arch.encode(sparse, masked)
    s.values = s.values.clone()
    s.values[first] += 1.0  # a masked event's item and attributes: not seen
    assert torch.equal(model.dense_arch.encode(sparse, masked), h)
    s.values[last] += 1.0  # an unmasked later event: seen by the earlier rows of its example only
    h2 = model.dense_arch.encode(sparse, masked)
    assert not torch.allclose(h[first], h2[first]) and torch.equal(h[last + 1 :], h2[last + 1 :])


def test_a_masked_item_pretraining_starts_a_next_event_run(tmp_path):
    _write_s3rec(tmp_path, num_users=80)
    common = [
        *_tiny_seqrec_gen(tmp_path),
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.log_every=5",
        "model.dropout=0.0",
    ]
    alone = "trainer.pretrain=[]"  # the experiment's own pretraining stage off: these two runs are the stages
    train(
        compose(
            [
                *common,
                alone,
                f"trainer.run_dir={tmp_path / 'pre'}",
                "model.objective=masked_item",
                "trainer.epochs=3",
                "checkpoint.enabled=true",
            ]
        )
    )
    pre = [json.loads(line) for line in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines()]
    pre_losses = [r["loss"] for r in pre if r["kind"] == "train"]
    assert pre_losses[-1] < pre_losses[0], pre_losses
    result = train(
        compose(
            [
                *common,
                alone,
                f"trainer.run_dir={tmp_path / 'ft'}",
                f"checkpoint.init_from={tmp_path / 'pre' / 'checkpoints'}",
                "checkpoint.init_modules=[sparse_arch,dense_arch]",
                "trainer.epochs=3",
            ]
        )
    )
    assert 0 <= result["next_item/hr@1"] <= result["next_item/hr@10"] <= 1
    assert "loaded" in (tmp_path / "ft" / "train.log").read_text()

    # the same two runs as one: the experiment's trainer.pretrain trains the stage in <run_dir>/pretrain first
    one = train(compose([*common, f"trainer.run_dir={tmp_path / 'one'}", "trainer.epochs=3"]))
    assert one | {"train_seconds": 0} == result | {"train_seconds": 0}
    for stage, run in (("one/pretrain", "pre"), ("one", "ft")):
        assert _losses(tmp_path / stage) == _losses(tmp_path / run)
    assert "loaded" in (tmp_path / "one" / "train.log").read_text()
    stage_result = json.loads((tmp_path / "one" / "pretrain" / "test_metrics.json").read_text())
    assert set(stage_result) == {"train_seconds", "steps"}  # the stage is not evaluated
    stage_s = stage_result["train_seconds"]
    imports = [json.loads((tmp_path / d / "startup.json").read_text())["imports"] for d in ("one/pretrain", "one")]
    assert imports[1] - imports[0] < stage_s / 2  # the run's start-up does not count the stage as its imports


def test_a_run_with_parameters_no_gradient_reaches_resumes_bit_identically(tmp_path):
    """The recipe leaves the user tokens' projections unused (no personalized FFN), so AdamW never
    creates their state; a restart still loads (its pretraining stage from its last checkpoint,
    the run from step 5's), and steps 6-15 match."""
    _write_s3rec(tmp_path, num_users=80)
    run = [
        *_tiny_seqrec_gen(tmp_path),
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=3",
        "trainer.log_every=1",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=5",
    ]
    train(compose([*run, f"trainer.run_dir={tmp_path / 'whole'}"]))
    _interrupt(tmp_path / "whole", tmp_path / "resumed", keep_through_step=5)
    train(compose([*run, f"trainer.run_dir={tmp_path / 'resumed'}"]))
    expected, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert max(expected) == 15 and [resumed[s] for s in range(6, 16)] == [expected[s] for s in range(6, 16)]
    assert "resumed from" in (tmp_path / "resumed" / "train.log").read_text()


def test_evaluating_mid_run_leaves_the_training_run_unchanged(tmp_path):
    """Validation every 2 steps used to draw from torch's random state (the evaluation loader's
    seed), so the run's later dropout and negatives, and its model, differed from a run without it."""
    _write_s3rec(tmp_path, num_users=60)
    run = [
        *_tiny_seqrec_gen(tmp_path),
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=3",
        "trainer.pretrain=[]",
    ]
    for every in (1000, 2):
        train(
            compose(
                [*run, "trainer.log_every=1", f"trainer.eval_every={every}", f"trainer.run_dir={tmp_path / str(every)}"]
            )
        )
    quiet, evaluated = _losses(tmp_path / "1000"), _losses(tmp_path / "2")
    assert len(quiet) == 9 and evaluated == quiet
    assert len([line for line in (tmp_path / "2" / "metrics.jsonl").read_text().splitlines() if '"val"' in line]) == 5


def test_pretrain_names_what_it_cannot_do(tmp_path):
    base = ["experiment=seqrec_gen", f"data.dir={tmp_path}", "data.name=Tiny"]
    with pytest.raises(ConfigError, match=r"trainer.pretrain: '\+model.x=1' is not a key=value override"):
        validate(compose([*base, "trainer.pretrain=['+model.x=1']"]))
    with pytest.raises(ConfigError, match="trainer.pretrain starts the run from its pretraining stage"):
        validate(compose([*base, "checkpoint.init_from=x", "checkpoint.init_modules=[sparse_arch]"]))  # it pretrains


@pytest.mark.parametrize(
    "block, pffn, ffn", [("interformer", True, 0), ("kunlun", True, 0), ("interformer", False, 0), ("kunlun", False, 2)]
)
def test_each_position_sees_only_its_past(generative_data, block, pffn, ffn):
    _, out = generative_data
    schema, batch = _batch(out)
    window = 2 if block == "kunlun" else None
    model = _model(schema, block, num_layers=3, window=window, pffn=pffn, ffn=ffn).eval()
    assert all((layer.pffn is not None) == pffn for layer in model.dense_arch.layers[::2])
    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    h = model.dense_arch.encode(sparse)
    s = sparse.sequences["hist"]
    first, last = int(s.offsets[0]), int(s.offsets[1]) - 1
    assert last > first, "the first example needs two events"
    s.values = s.values.clone()
    s.values[last] += 1.0  # change the first example's last event only
    h2 = model.dense_arch.encode(sparse)
    assert torch.equal(h[:last], h2[:last]) and not torch.allclose(h[last], h2[last])
    assert torch.equal(h[last + 1 :], h2[last + 1 :])


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.block=interformer"],
        ["model.block=kunlun", "model.window=3"],
        ["sparse=torchrec", "model.negatives=null"],
        ["model.negatives=null", "model.attribute_loss=0.5"],  # as experiment=seqrec_gen_lastfm
        ["model.cooccurrence=2.0"],  # the prior from the training split, set by the trainer's build_model
        pytest.param(["trainer.device=cuda"], marks=pytest.mark.gpu, id="cuda-native"),
        # the item table shared by the candidate, the history and the negatives, sharded on one GPU (FBGEMM's kernels)
        pytest.param(
            ["trainer.device=cuda", "sparse=torchrec"], marks=[pytest.mark.gpu, needs_fbgemm_cuda], id="cuda-fbgemm"
        ),
    ],
)
def test_seqrec_gen_experiment_learns_and_reports_ranking_metrics(tmp_path, overrides):
    _write_s3rec(tmp_path, num_users=80)
    result = train(
        compose(
            [
                *_tiny_seqrec_gen(tmp_path),
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.epochs=6",
                "trainer.log_every=5",
                "model.dropout=0.0",
                # the recipe's 50 warm-up steps outlast the test's 30, whose loss then fell by about its
                # windows' noise (0.08-0.34 over seeds and devices); 5 leaves a fall of about 0.3
                "optim.warmup_steps=5",
                "trainer.device=cpu",  # also on a GPU machine: the cuda cases set their device
                *overrides,
            ]
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    pretrain_losses = list(_losses(tmp_path / "run" / "pretrain").values())  # masked item prediction first
    assert pretrain_losses[-1] < pretrain_losses[0] - 0.2, pretrain_losses
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    assert result["next_item/groups"] == 80 and 0 <= result["next_item/hr@1"] <= result["next_item/hr@10"] <= 1
    assert all(r["tflops"] > 0 for r in rows if r["kind"] == "train")
    if torch.distributed.is_initialized():  # sharded tables started a one-rank group
        torch.distributed.destroy_process_group()


def test_a_pretrained_next_event_model_fine_tunes_on_ranking_rows(tmp_path):
    """model.objective=ranking on pointwise rows (data.seqrec.objective=pointwise), its tables and
    blocks started from a next-event run's checkpoint: with learning rates of 1e-12 it scores the test
    users exactly as the pretrained model did; with the recipe's rates its BCE loss falls."""
    _write_s3rec(tmp_path, num_users=80)
    common = [
        *_tiny_seqrec_gen(tmp_path),
        "trainer.log_every=1",
        "model.dropout=0.0",
        "trainer.pretrain=[]",  # the fine-tune starts from the next-event run instead
        "model.cooccurrence=0",  # pointwise prefixes leave each user's last training event out of the prior
    ]
    pretrained = train(
        compose(
            [
                *common,
                f"data.cache_dir={tmp_path / 'c1'}",
                f"trainer.run_dir={tmp_path / 'pre'}",
                "trainer.epochs=3",
                "checkpoint.enabled=true",
            ]
        )
    )
    step = next((tmp_path / "pre" / "checkpoints").glob("step_*"))
    fine_tune = [
        *common,
        f"data.cache_dir={tmp_path / 'c2'}",
        "data.seqrec.objective=pointwise",
        "model.objective=ranking",
        "model.negatives=null",
        f"checkpoint.init_from={step}",
        "checkpoint.init_modules=[sparse_arch,dense_arch]",
        "trainer.max_steps=4",
    ]
    frozen = train(
        compose([*fine_tune, f"trainer.run_dir={tmp_path / 'lr0'}", "optim.dense.lr=1e-12", "optim.sparse.lr=1e-12"])
    )
    for metric in ("next_item/hr@1", "next_item/hr@10", "next_item/ndcg@10", "next_item/mrr"):
        assert frozen[metric] == pytest.approx(pretrained[metric], abs=1e-6), metric
    train(compose([*fine_tune, f"trainer.run_dir={tmp_path / 'ft'}", "trainer.max_steps=12"]))
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_the_shared_ffn_and_residual_dropout(generative_data):
    _, out = generative_data
    schema, batch = _batch(out)
    base = _model(schema, pffn=False).eval()
    model = _model(schema, pffn=False, ffn=2, residual_dropout=0.5).eval()
    layer, base_layer = model.dense_arch.layers[0], base.dense_arch.layers[0]
    assert base_layer.ffn is None and base_layer.attention.dropout is None
    assert (layer.ffn.up.in_features, layer.ffn.up.out_features) == (16, 32)  # 2 x the row width of 2 x 8
    lengths = torch.tensor([3, 5])
    assert layer.flops(lengths, 5, False) - base_layer.flops(lengths, 5, False) == 2 * (2 * 8 * 16 * 32)

    sparse = model.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
    h = model.dense_arch.encode(sparse)
    assert torch.equal(h, model.dense_arch.encode(sparse))  # evaluation: no dropout
    assert not torch.allclose(h, base.dense_arch.encode(sparse))  # the FFN changes the states
    model.train()  # model.dropout is 0 here: only the residual branches drop
    assert not torch.allclose(model.dense_arch.encode(sparse), model.dense_arch.encode(sparse))


def test_item_cooccurrence_is_the_cosine_over_the_users_holding_both_items(generative_data):
    sequences, out = generative_data
    num_items = schema_from_files(split_files(out, "train")).cardinality("hist_item")
    keys, values = item_cooccurrence(split_files(out, "train"), num_items)
    users = [set(s[:-2][-OPTIONS.max_len :].tolist()) for s in sequences]  # what the training rows hold
    holders = {i: sum(i in u for u in users) for u in users for i in u}
    expected = {}
    for u in users:
        for i in u:
            for j in u - {i}:
                expected[i * num_items + j] = expected.get(i * num_items + j, 0) + 1
    expected = {k: c / math.sqrt(holders[k // num_items] * holders[k % num_items]) for k, c in expected.items()}
    assert keys.tolist() == sorted(expected)
    assert values.tolist() == pytest.approx([expected[k] for k in keys.tolist()], rel=1e-6)
    with pytest.raises(DataError, match=r"no column \['nope'\]; use a seqrec data set"):
        item_cooccurrence(split_files(out, "train"), num_items, user_feature="nope")


def test_the_cooccurrence_prior_adds_to_the_ranking_score(generative_data):
    """model.cooccurrence: ``gamma * log(1 + sum_j S[j, c])`` over the row's last events ``j``,
    added to the score of the same weights without it."""
    _, out = generative_data
    schema, batch = _batch(out, "test", batch_size=100)
    num_items = schema.cardinality("hist_item")
    keys, values = item_cooccurrence(split_files(out, "train"), num_items)
    base = _model(schema).eval()
    model = _model(schema, cooccurrence=2.0, cooccurrence_window=3).eval()
    with pytest.raises(RuntimeError, match="co-occurrence was never set"):
        model(batch)
    model.dense_arch.set_cooccurrence(torch.as_tensor(keys), torch.as_tensor(values))
    S = dict(zip(keys.tolist(), values.tolist()))
    hist = batch.sequences.to_dict()["hist_item"]
    starts = [0, *hist.lengths().cumsum(0).tolist()]
    candidates = batch.sparse.to_dict()["item_id"].values().tolist()
    expected = []
    for b, c in enumerate(candidates):
        recent = hist.values()[starts[b] : starts[b + 1]][-3:].tolist()
        expected.append(2.0 * math.log1p(sum(S.get(j * num_items + c, 0.0) for j in recent)))
    added = (model(batch) - base(batch)).squeeze(1)
    assert sum(e > 0 for e in expected) > 20  # most candidates co-occur with a recent event
    torch.testing.assert_close(added, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_generative_arch_names_what_it_needs(generative_data):
    _, out = generative_data
    schema = schema_from_files(split_files(out, "train"))
    with pytest.raises(ValueError, match="model.negatives='nope'"):
        _model(schema, negatives="nope")
    with pytest.raises(ValueError, match="leaves no user id feature"):
        _model(schema, candidate_features=("item_id", "item_attr", "user_id"))
    with pytest.raises(ValueError, match=r"model.label_smoothing=1.0 must be in \[0, 1\)"):
        _model(schema, label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"attribute_loss=0.1 must be >= 0 and needs .* model.item_attributes=true"):
        _model(schema, attribute_loss=0.1)
    with pytest.raises(ValueError, match=r"model.ffn=-1 must be >= 0"):
        _model(schema, ffn=-1)
    with pytest.raises(ValueError, match=r"model.residual_dropout=1.0 in \[0, 1\)"):
        _model(schema, residual_dropout=1.0)
    with pytest.raises(ValueError, match=r"model.cooccurrence=-1.0 must be >= 0"):
        _model(schema, cooccurrence=-1.0)
    with pytest.raises(ValueError, match=r"model.cooccurrence_window=0 >= 1"):
        _model(schema, cooccurrence=1.0, cooccurrence_window=0)
    with pytest.raises(ValueError, match="data.seqrec.objective='listwise'"):
        SeqRecOptions.from_config({"objective": "listwise"})


def test_conversion_counts_what_it_cannot_learn(tmp_path):
    """A user of two events, an id gap, items only seen as evaluation targets and items the
    attribute file lacks: counted in conversion.json, not an error."""
    (tmp_path / "Odd.txt").write_text("1 1 2 3 4\n2 2 3\n3 5 2 3 9\n4 1 3 2 4\n")  # item 6, 7, 8 never occur
    (tmp_path / "Odd_item2attributes.json").write_text(json.dumps({"1": [1], "2": [2], "3": [1, 2]}))
    summary = write_seqrec(read_s3rec(tmp_path, "Odd"), tmp_path / "out", OPTIONS)
    assert summary["users_dropped_under_3_events"] == 1 and summary["users_kept"] == 3
    assert summary["item_ids_never_seen"] == 3  # 6, 7, 8
    assert summary["items_only_in_evaluation"] == 2  # 4 and 9: validation / test targets, nobody's training event
    assert summary["items_without_attributes"] == 6  # 4 .. 9
    saved = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert saved["items_only_in_evaluation"] == 2
