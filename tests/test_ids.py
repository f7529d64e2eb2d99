"""Unbounded ids (gem/sparse/ids.py, ``sparse.ids``): the hash and modulo maps, managed collisions
(admission, LRU / LFU eviction, the counts), bad ids, the mapping state through checkpoints, and
sharded (2 gloo ranks) vs one-process parity with mapped ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.sparse.arch import SparseArch
from gem.sparse.ids import IdMapper, IdOutOfRangeError, IdSpace, build_id_spaces, hash_ids
from gem.sparse.tables import build_tables
from gem.train.config import ConfigError, validate
from tests.conftest import compose
from tests.ids_worker import run_ids_case
from tests.test_distributed import _errors, torchrun

M64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer on unsigned 64-bit Python ints (the reference of hash_ids)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _kjt(features: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    """A KJT from per-feature lists of per-example ids."""
    keys = list(features)
    values = [i for k in keys for row in features[k] for i in row]
    lengths = [len(row) for k in keys for row in features[k]]
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int32)
    )


def _mapper(policy: str, rows: int = 5, features=("user_id",), **kw) -> IdMapper:
    return IdMapper([IdSpace("t_user_id", rows, tuple(features), policy=policy, **kw)])


_EMPTY = KeyedJaggedTensor.empty()


def _map(mapper: IdMapper, ids: list[int]) -> list[int]:
    out, _ = mapper(_kjt({"user_id": [[i] for i in ids]}), _EMPTY)
    return out.values().tolist()


# ------------------------------------------------------------------------------------ stateless maps


@pytest.mark.parametrize("num_rows", [1, 7, 1000, 2**31 - 1])
def test_hash_ids_is_splitmix64_modulo_the_rows(num_rows):
    raw = [0, 1, 2, 12345, 2**32, 2**62 + 17, 2**63 - 1]
    got = hash_ids(torch.tensor(raw), num_rows).tolist()
    assert got == [(_splitmix64(x) & (2**63 - 1)) % num_rows for x in raw]
    assert all(0 <= r < num_rows for r in got)


def test_hash_and_modulo_map_every_feature_of_the_table_in_both_kjts_and_keep_lengths():
    spaces = [
        IdSpace("t_item", 10, ("ad_id", "hist_item"), policy="hash"),
        IdSpace("t_user_id", 4, ("user_id",), policy="modulo"),
    ]
    mapper = IdMapper(spaces)
    sparse = _kjt({"user_id": [[9], [2**40 + 1]], "ad_id": [[2**50], [3]], "ad_cluster": [[1], [2]]})
    seq = _kjt({"hist_item": [[2**50, 5], []], "hist_action": [[1, 2], []]})
    out_sparse, out_seq = mapper(sparse, seq)
    assert out_sparse.keys() == sparse.keys() and torch.equal(out_sparse.lengths(), sparse.lengths())
    assert torch.equal(out_seq.lengths(), seq.lengths())
    d, s = out_sparse.to_dict(), out_seq.to_dict()
    assert d["user_id"].values().tolist() == [9 % 4, (2**40 + 1) % 4]
    assert d["ad_id"].values().tolist() == hash_ids(torch.tensor([2**50, 3]), 10).tolist()
    assert s["hist_item"].values()[0] == d["ad_id"].values()[0], "one table, one map: the same raw id, the same row"
    assert d["ad_cluster"].values().tolist() == [1, 2] and s["hist_action"].values().tolist() == [1, 2]


def test_collisions_count_raw_ids_sharing_a_row_in_a_training_batch():
    mapper = _mapper("modulo", rows=5)
    _map(mapper, [1, 6, 11, 2, 2])  # 1, 6, 11 share row 1; the repeated 2 is one raw id
    assert mapper.pop_counts() == {"ids/t_user_id/collisions": 2.0}
    mapper.eval()
    _map(mapper, [1, 6])
    assert mapper.pop_counts() == {"ids/t_user_id/collisions": 0.0}, "evaluation batches are not counted"


# ------------------------------------------------------------------------------------ managed collisions


def test_mch_admits_new_ids_and_unadmitted_ones_share_the_last_row():
    mapper = _mapper("mch", rows=4, eviction="lfu", eviction_interval=2)
    first = _map(mapper, [10**15, 7])  # step 1: not an admission step yet
    assert first == [3, 3], "ids seen before their admission look up the shared last row"
    assert mapper.pop_counts()["ids/t_user_id/collisions"] == 1.0
    second = _map(mapper, [10**15, 7, 99])  # step 2: admission of every id seen in steps 1-2
    assert len(set(second)) == 3 and 3 not in second and all(0 <= r < 3 for r in second)
    counts = mapper.pop_counts()
    assert counts["ids/t_user_id/occupied"] == 3.0 and counts["ids/t_user_id/evictions"] == 0.0
    assert _map(mapper, [7, 99, 10**15]) == [second[1], second[2], second[0]], "admitted ids keep their rows"


@pytest.mark.parametrize("eviction, kept", [("lru", [5, 6]), ("lfu", [1, 2])])
def test_mch_eviction_frees_the_least_recent_or_least_frequent_rows(eviction, kept):
    """3 usable rows. Ids 1, 2 are seen three times early; then 3 once, then 5 and 6 (a full table
    needs evictions). LRU keeps the latest ids, LFU the frequent ones."""
    mapper = _mapper("mch", rows=4, eviction=eviction)
    for _ in range(3):
        _map(mapper, [1, 2])
    _map(mapper, [3])
    assert mapper.pop_counts()["ids/t_user_id/evictions"] == 0.0
    _map(mapper, [5, 6])
    evictions = mapper.pop_counts()["ids/t_user_id/evictions"]
    rows = _map(mapper, kept)
    assert 3 not in rows and len(set(rows)) == 2, f"{eviction} keeps {kept} in rows of their own"
    assert evictions == (2.0 if eviction == "lru" else 0.0)


def test_mch_without_eviction_fills_the_table_then_new_ids_share_the_last_row():
    mapper = _mapper("mch", rows=4, eviction="none")
    first = _map(mapper, [1, 2])
    assert _map(mapper, [3, 3, 3, 4])[0] != 3, "the frequent new id takes the one free row"
    assert _map(mapper, [5, 6]) == [3, 3], "a full table admits no more: new ids share the last row"
    assert _map(mapper, [1, 2]) == first, "a mapped id keeps its row for good"
    counts = mapper.pop_counts()
    assert counts["ids/t_user_id/evictions"] == 0.0 and counts["ids/t_user_id/occupied"] == 3.0


def test_mch_admits_ids_of_batches_larger_than_the_first():
    """TorchRec sizes its history from the first batch; later, longer batches still have every id admitted."""
    mapper = _mapper("mch", rows=200, eviction_interval=2)
    _map(mapper, [1])
    _map(mapper, list(range(100, 180)))  # 81 ids in this admission, 2.5 x the first batch's room
    assert mapper.pop_counts()["ids/t_user_id/occupied"] == 81.0


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad", [-1, 1000])
def test_an_id_outside_the_raw_space_names_feature_id_and_space_and_changes_no_state(bad):
    spaces = [
        IdSpace("t_user_id", 8, ("user_id",), raw_space=1000, policy="mch"),
        IdSpace("t_ad_id", 8, ("ad_id",), raw_space=1000, policy="mch"),
    ]
    mapper = IdMapper(spaces)
    mapper(_kjt({"user_id": [[1]], "ad_id": [[2]]}), _EMPTY)
    before = {k: v.clone() for k, v in mapper.state_dict().items()}
    with pytest.raises(IdOutOfRangeError, match=rf"feature 'ad_id': id {bad} is outside .*\[0, 1000\)"):
        mapper(_kjt({"user_id": [[5]], "ad_id": [[bad]]}), _EMPTY)
    for key, value in mapper.state_dict().items():
        assert torch.equal(value, before[key]), f"{key}: a rejected batch changed the mapping"


def test_config_checks_the_ids_keys(tiny_schema):
    base = ["debug=tiny"]
    for override, match in [
        ("+sparse.ids.t_user_id.policy=lsh", "sparse.ids.t_user_id.policy"),
        ("+sparse.ids.t_user_id.eviction=fifo", "sparse.ids.t_user_id.eviction"),
        ("+sparse.ids.t_user_id.raw_space=0", "sparse.ids.t_user_id.raw_space"),
        ("+sparse.ids.t_user_id.eviction_interval=0", "sparse.ids.t_user_id.eviction_interval"),
        ("+sparse.ids.t_user_id.size=3", "sparse.ids.t_user_id.size"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(compose([*base, override]))
    tables = build_tables(tiny_schema, 8, 0.05)
    with pytest.raises(ValueError, match=r"sparse.ids.t_nope: unknown table; the tables are \[.*'t_user_id'"):
        build_id_spaces(tables, {"t_nope": {"policy": "hash"}})
    (space,) = build_id_spaces(tables, validate(compose([*base, "+sparse.ids.t_ad_id.policy=hash"])).sparse.ids)
    assert (space.table, space.num_embeddings, space.raw_space, space.policy) == ("t_ad_id", 80, 2**63, "hash")


# ------------------------------------------------------------------------------------ state and parity


def test_mapping_state_is_in_the_state_dict_and_loads_exactly(tiny_schema):
    ids = {"t_user_id": {"policy": "mch", "eviction": "lru"}, "t_ad_id": {"policy": "mch", "eviction": "lfu"}}
    a = SparseArch.from_config(tiny_schema, 8, backend="native", ids=ids)
    a.init_weights()
    g = torch.Generator().manual_seed(0)
    batches = [
        _kjt(
            {
                "user_id": [[int(i)] for i in torch.randint(0, 2**60, (6,), generator=g)],
                "ad_id": [[int(i)] for i in torch.randint(0, 200, (6,), generator=g)],
                "ad_cluster": [[0]] * 6,
                "user_interests": [[1]] * 6,
            }
        )
        for _ in range(30)
    ]
    seq = _kjt({f: [[]] * 6 for f in tiny_schema.sequence_feature_names})
    for b in batches[:20]:
        a(b, seq, {"hist": 0})
    keys = [k for k in a.state_dict() if k.startswith("ids.")]
    assert {
        "ids.mch.t_user_id._mch_sorted_raw_ids",
        "ids.mch.t_user_id._mch_remapped_ids_mapping",
        "ids.mch.t_user_id._mch_last_access_iter",
        "ids.mch.t_ad_id._mch_counts",
        "ids.mch.t_ad_id._current_iter_tensor",
    } <= set(keys)
    b = SparseArch.from_config(tiny_schema, 8, backend="native", ids=ids)
    b.load_state_dict(a.state_dict())
    for batch in batches[20:]:  # both go on from the same state: the same rows, the same evictions
        assert a.ids(batch, seq)[0].values().tolist() == b.ids(batch, seq)[0].values().tolist()
    assert a.ids.pop_counts()["ids/t_user_id/evictions"] > 0
    for key in keys:
        assert torch.equal(a.state_dict()[key], b.state_dict()[key]), key


@pytest.mark.parametrize("plan", ["row_wise", "table_wise"])
def test_two_sharded_ranks_match_one_process_with_mapped_ids(tiny_dataset, tmp_path, plan):
    """TorchRec-sharded tables on 2 gloo ranks, FSDP2 dense, mch (LRU and LFU with evictions) and hash
    tables: the same losses as one process on the global batches, the same mapping state."""
    out = tmp_path / "ids.json"
    proc = torchrun(
        ["tests/ids_worker.py", "--data", str(tiny_dataset), "--out", str(out), "--plan", plan, "--batch", "16"],
        2,
        timeout=180,
    )
    assert proc.returncode == 0, _errors(proc.stderr)
    got = json.loads(out.read_text())
    expected = run_ids_case(Path(tiny_dataset), 32, 1, None)
    assert max(expected["losses"]) - min(expected["losses"]) > 1e-2, "the reference does not train"
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert got["state"] == expected["state"]
    assert expected["counts"]["ids/t_user_id/evictions"] > 0, "the case evicts"
    for key in ("ids/t_user_id/evictions", "ids/t_user_id/occupied", "ids/t_ad_id/occupied"):
        assert got["counts"][key] == expected["counts"][key], key


# ------------------------------------------------------------------------------------ checkpoints

IDS_RUN = [
    "debug=tiny",
    "trainer.deterministic=true",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "checkpoint.enabled=true",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=0",
    "+sparse.ids.t_user_id.policy=mch",
    "+sparse.ids.t_hist_item.policy=mch",
    "+sparse.ids.t_hist_item.eviction=lfu",
    "+sparse.ids.t_hist_item.eviction_interval=5",
    "+sparse.ids.t_ad_id.policy=hash",
]


def _run(cache_dir, run_dir, *extra) -> list[str]:
    return [*IDS_RUN, f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *extra]


def _train_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def _mapping_state(step_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The mapping tensors (``model.sparse.ids.*``) of a DCP checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = tmp_path / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, full)
    state = {k: v for k, v in torch.load(full, weights_only=False).items() if k.startswith("model.sparse.ids.")}
    assert state, f"{step_dir} holds no mapping state"
    return state


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ids_run(cache_dir, tmp_path_factory):
    """One process, 20 steps, mch (LRU every step, LFU every 5 steps) and hash tables, a checkpoint every 5 steps."""
    from gem.train.trainer import train

    run_dir = tmp_path_factory.mktemp("ids_single")
    train(compose(_run(cache_dir, run_dir)))
    return run_dir


def test_resume_restores_the_mapping_exactly(cache_dir, ids_run, tmp_path):
    """Crash after step 10's checkpoint and restart: steps 11-20 give the same losses and counts, bit for
    bit, and the final mapping state equals the uninterrupted run's."""
    import shutil

    from gem.train.checkpoint import list_checkpoints
    from gem.train.trainer import train

    shutil.copytree(ids_run, tmp_path / "run")
    for ckpt in list_checkpoints(tmp_path / "run" / "checkpoints"):
        if int(ckpt.name.split("_")[1]) > 10:
            shutil.rmtree(ckpt)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    train(compose(_run(cache_dir, tmp_path / "run")))
    expected, resumed = _train_rows(ids_run), _train_rows(tmp_path / "run")
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        for key in ["loss"] + [k for k in expected[step] if k.startswith("ids/")]:
            assert resumed[step][key] == expected[step][key], (step, key)
    assert expected[20]["ids/t_user_id/occupied"] > expected[5]["ids/t_user_id/occupied"] > 0
    final = "checkpoints/step_000000020"
    a, b = _mapping_state(ids_run / final, tmp_path), _mapping_state(tmp_path / "run" / final, tmp_path)
    assert a.keys() == b.keys() and any("_mch_counts" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_mapping_survives_resharding_two_ranks_into_one(cache_dir, tmp_path):
    """Two gloo ranks (TorchRec-sharded tables, FSDP2) save at step 10; one process restores exactly that
    mapping (it is replicated, so any world size loads it) and trains on from it."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from gem.train.checkpoint import Checkpointer, sparse_module
    from gem.train.optim import build_optimizers
    from gem.train.setup import build_model, init_distributed, load_data
    from gem.train.trainer import train

    two = tmp_path / "two"
    proc = torchrun(["-m", "gem.train", *_run(cache_dir, two, "trainer.max_steps=10")], 2, timeout=240)
    assert proc.returncode == 0, _errors(proc.stderr)
    source = two / "checkpoints" / "step_000000010"
    saved = _mapping_state(source, tmp_path)
    config = validate(compose(_run(cache_dir, tmp_path / "one", f"checkpoint.load_from={source}")))
    env = init_distributed("cpu", need_process_group=True)
    try:
        schema, _ = load_data(config, env)
        model = build_model(config, schema, env)
        dense_opt, sparse_opt, scheduler = build_optimizers(model, config.optim, total_steps=20)
        ckpt = Checkpointer(
            config.checkpoint,
            tmp_path / "one" / "checkpoints",
            model,
            dense_opt,
            sparse_opt,
            scheduler,
            OmegaConf.to_yaml(OmegaConf.structured(config)),
        )
        assert ckpt.restore().step == 10
        loaded = {f"model.sparse.ids.{k}": v for k, v in sparse_module(model).ids.state_dict().items()}
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
    finally:
        dist.destroy_process_group()
    train(compose(_run(cache_dir, tmp_path / "run", f"checkpoint.load_from={source}", "data.batch_size=128")))
    rows = _train_rows(tmp_path / "run")
    assert sorted(rows) == list(range(11, 21))
    assert (
        rows[20]["ids/t_user_id/occupied"]
        >= int((saved["model.sparse.ids.mch.t_user_id._mch_sorted_raw_ids"] != torch.iinfo(torch.int64).max).sum())
        > 0
    )


def test_training_on_an_id_above_the_raw_space_stops_naming_it_and_keeps_the_checkpoints(cache_dir, ids_run, tmp_path):
    """The resumed run meets ids above a (now smaller) declared space at its first step: it stops with the
    feature, the id and the space named, and the checkpoints it started from are untouched."""
    import shutil

    from gem.train.checkpoint import list_checkpoints
    from gem.train.trainer import train

    shutil.copytree(ids_run / "checkpoints", tmp_path / "run" / "checkpoints")
    before = {p.name: sorted(f.name for f in p.iterdir()) for p in list_checkpoints(tmp_path / "run" / "checkpoints")}
    with pytest.raises(
        IdOutOfRangeError, match=r"feature 'user_id': id \d+ is outside its declared raw space \[0, 3\)"
    ):
        train(compose(_run(cache_dir, tmp_path / "run", "trainer.max_steps=25", "+sparse.ids.t_user_id.raw_space=3")))
    after = {p.name: sorted(f.name for f in p.iterdir()) for p in list_checkpoints(tmp_path / "run" / "checkpoints")}
    assert after == before
