"""Delta export (gem/train/delta.py): a base checkpoint plus the chain of deltas gives the run's final
weights bit for bit (TorchRec-sharded and native tables, managed-collision ids, optimizer state), after
a restart too; gaps, deltas out of order and a base that is too old fail naming the problem, and so
do a base of another run (lineage), a base of other table shapes and a damaged manifest.
Every run is the tiny debug config: 20 steps of 64 examples, a delta and a checkpoint every 5 steps."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gem.train.checkpoint import list_checkpoints
from gem.train.config import ConfigError, validate
from gem.train.delta import DeltaChainError, apply_chain, load_checkpoint_state, main, read_chain
from gem.train.trainer import train
from tests.conftest import compose

RUN = [
    "debug=tiny",
    "trainer.deterministic=true",
    "checkpoint.enabled=true",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=0",
    "trainer.delta_export.every=5",
    "trainer.plots=false",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _train(cache_dir, run_dir, *extra):
    train(compose([*RUN, f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *extra]))
    return Path(run_dir)


def _state(folder: Path, tmp: Path) -> dict:
    dcp_to_torch_save(folder, tmp / "state.pt")
    return torch.load(tmp / "state.pt", weights_only=False)


def _assert_same(applied: dict, final: dict, prefixes: tuple[str, ...]) -> None:
    keys = sorted(k for k in final if k.startswith(prefixes) and isinstance(final[k], torch.Tensor))
    assert keys and any(".weight" in k for k in keys)
    for key in keys:
        torch.testing.assert_close(applied[key], final[key], rtol=0, atol=0, msg=key)


def _lineage(checkpoint: Path) -> str:
    return json.loads((checkpoint / "gem_checkpoint.json").read_text())["lineage"]


def _apply_cli(run_dir: Path, base_step: int, out: Path) -> dict:
    base = run_dir / "checkpoints" / f"step_{base_step:09d}"
    assert main(["apply", "--base", str(base), "--deltas", str(run_dir / "deltas"), "--out", str(out)]) == 0
    return _state(out, out.parent)


@pytest.fixture(scope="module")
def sharded_run(cache_dir, tmp_path_factory):
    """TorchRec tables sharded on one rank (fused row-wise Adagrad), with the optimizer state."""
    return _train(cache_dir, tmp_path_factory.mktemp("sharded"), "trainer.delta_export.optimizer_state=true")


def test_chain_has_the_touched_rows_only(sharded_run):
    chain = read_chain(sharded_run / "deltas")
    assert [(m["seq"], m["base_step"], m["step"]) for m in chain] == [(0, 0, 5), (1, 5, 10), (2, 10, 15), (3, 15, 20)]
    assert [m["previous"] for m in chain] == [None, 0, 1, 2]
    rows = chain[0]["tables"]["t_hist_item"]
    assert 0 < rows["rows"] < rows["num_embeddings"]  # a delta, not the whole table
    part = torch.load(sharded_run / "deltas" / "000000" / "sparse.pt")["ec.embeddings.t_hist_item.weight"]
    assert part["rows"].shape == (rows["rows"], rows["dim"]) and torch.equal(part["ids"], part["ids"].unique())
    assert (list_checkpoints(sharded_run / "checkpoints")[0]).name == "step_000000000"  # the chain's base


def test_base_plus_chain_is_the_final_checkpoint(sharded_run, tmp_path):
    """Weights and optimizer state (the touched rows' momentum, AdamW) from step 0 and from step 10."""
    final = _state(sharded_run / "checkpoints" / "step_000000020", tmp_path)
    for base_step in (0, 10):
        out = tmp_path / f"from{base_step}"
        out.mkdir()
        applied = _apply_cli(sharded_run, base_step, out / "state")
        _assert_same(applied, final, ("model.", "optim."))
        assert json.loads((out / "state" / "applied.json").read_text())["deltas"] == (
            [0, 1, 2, 3] if base_step == 0 else [2, 3]
        )


def test_base_alone_differs_from_the_final_checkpoint(sharded_run, tmp_path):
    """The comparison above can fail: the base is not the end of training."""
    base, _ = load_checkpoint_state(sharded_run / "checkpoints" / "step_000000000")
    final = _state(sharded_run / "checkpoints" / "step_000000020", tmp_path)
    key = "model.sparse.ec.embeddings.t_hist_item.weight"
    assert not torch.equal(base[key], final[key])


@pytest.mark.parametrize(
    "extra",
    [
        ["sparse=native"],
        [
            "+sparse.ids.t_user_id.policy=mch",
            "+sparse.ids.t_hist_item.policy=mch",
            "+sparse.ids.t_hist_item.eviction=lfu",
            "+sparse.ids.t_user_id.raw_space=1000000",
        ],
    ],
    ids=["native", "mch"],
)
def test_other_backends_and_mapped_ids(cache_dir, tmp_path, extra):
    """Native tables (plain RowWiseAdagrad) and managed-collision ids (the mapping state travels whole)."""
    run = _train(cache_dir, tmp_path / "run", *extra)
    final = _state(run / "checkpoints" / "step_000000020", tmp_path)
    applied = _apply_cli(run, 0, tmp_path / "applied")
    _assert_same(applied, final, ("model.",))
    if "mch" in extra[0]:
        assert any(k.startswith("model.sparse.ids.mch.t_hist_item.") for k in final)


def _crash(run: Path, dst: Path, checkpoint_through: int, deltas_through: int) -> Path:
    """A copy of ``run`` as if it had been killed with checkpoints and deltas up to those steps."""
    shutil.copytree(run, dst)
    for ckpt in list_checkpoints(dst / "checkpoints"):
        if int(ckpt.name.split("_")[1]) > checkpoint_through:
            shutil.rmtree(ckpt)
    for m in read_chain(dst / "deltas"):
        if m["step"] > deltas_through:
            shutil.rmtree(dst / "deltas" / f"{m['seq']:06d}")
    (dst / "metrics.jsonl").unlink()
    return dst


@pytest.mark.parametrize("deltas_through", [15, 5], ids=["delta_after_checkpoint", "delta_before_checkpoint"])
def test_restart_keeps_the_chain_exact(cache_dir, sharded_run, tmp_path, deltas_through):
    """Killed after the checkpoint of step 10 with the deltas through step 15 (dropped and written
    again) or through step 5 (the rows of steps 6..10 are unknown: the next delta carries every row)."""
    run = _crash(sharded_run, tmp_path / "run", 10, deltas_through)
    _train(cache_dir, run, "trainer.delta_export.optimizer_state=true")
    chain = read_chain(run / "deltas")
    if deltas_through == 15:
        assert [(m["step"], m["full"]) for m in chain] == [(5, False), (10, False), (15, False), (20, False)]
    else:  # delta 1: steps 6..15, every row
        assert [(m["base_step"], m["step"], m["full"]) for m in chain] == [
            (0, 5, False),
            (5, 15, True),
            (15, 20, False),
        ]
    final = _state(sharded_run / "checkpoints" / "step_000000020", tmp_path)  # the uninterrupted run's
    applied = _apply_cli(run, 0, tmp_path / "applied")
    _assert_same(applied, final, ("model.", "optim."))
    # The resumed run kept the run's lineage: in the checkpoints and deltas it wrote after the restart.
    lineage = _lineage(sharded_run / "checkpoints" / "step_000000000")
    assert {m["lineage"] for m in chain} == {lineage}
    assert {_lineage(c) for c in list_checkpoints(run / "checkpoints")} == {lineage}


def _copy_deltas(run: Path, dst: Path, seqs: list[int]) -> Path:
    dst.mkdir()
    for s in seqs:
        shutil.copytree(run / "deltas" / f"{s:06d}", dst / f"{s:06d}")
    return dst


def test_gap_in_the_chain_names_the_missing_seq(sharded_run, tmp_path):
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [0, 1, 3])
    base, step = load_checkpoint_state(sharded_run / "checkpoints" / "step_000000000")
    with pytest.raises(DeltaChainError, match="has a gap: seq 000002 missing between 000001 .step 10. and 000003"):
        apply_chain(base, step, deltas)


def test_base_older_than_the_chain_names_the_missing_steps(sharded_run, tmp_path):
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [2, 3])
    base, step = load_checkpoint_state(sharded_run / "checkpoints" / "step_000000005")
    with pytest.raises(
        DeltaChainError,
        match=r"delta 000002 patches the state of step 10, later than the base's step "
        r"5: the deltas of steps 6..10 are missing",
    ):
        apply_chain(base, step, deltas)


def test_deltas_out_of_order_or_damaged(sharded_run, tmp_path, capsys):
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [0, 1, 2])
    manifest = deltas / "000002" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "base_step": 7}))  # another run's delta under this seq
    base, step = load_checkpoint_state(sharded_run / "checkpoints" / "step_000000000")
    with pytest.raises(DeltaChainError, match="delta 000002 .* is out of order: it patches seq 1 at step 7"):
        apply_chain(base, step, deltas)
    manifest.write_text(json.dumps(m))
    with (deltas / "000001" / "dense.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(DeltaChainError, match="000001: file dense.pt is missing, truncated or corrupted"):
        apply_chain(base, step, deltas)
    assert (
        main(
            [
                "apply",
                "--base",
                str(sharded_run / "checkpoints" / "step_000000000"),
                "--deltas",
                str(deltas),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 1
    )
    assert "Error in the delta chain" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override, match",
    [
        (["trainer.delta_export.every=0"], "trainer.delta_export.every='0' must be partition, a number of steps > 0"),
        (["trainer.delta_export.every=often"], "trainer.delta_export.every='often'"),
    ],
)
def test_delta_export_config_is_validated(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose(["debug=tiny", *override]))


@pytest.mark.parametrize(
    "override, match",
    [
        (["checkpoint.enabled=false"], "trainer.delta_export needs checkpoint.enabled=true"),
        (["trainer.delta_export.every=partition"], "every=partition needs a streamed data source"),
    ],
)
def test_delta_export_needs_a_checkpoint_and_partitions(cache_dir, tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _train(cache_dir, tmp_path / "run", *override)


# ----------------------------------------------------------------------------------- lineage


def test_checkpoints_and_deltas_carry_the_run_lineage(sharded_run, tmp_path):
    """One id for the run: in every checkpoint (its manifest and its DCP state) and every delta."""
    checkpoints = list_checkpoints(sharded_run / "checkpoints")
    lineage = _lineage(checkpoints[0])
    assert re.fullmatch("[0-9a-f]{32}", lineage)
    assert {_lineage(c) for c in checkpoints} == {lineage}
    assert _state(checkpoints[-1], tmp_path)["lineage"] == lineage
    assert {m["lineage"] for m in read_chain(sharded_run / "deltas")} == {lineage}


@pytest.fixture(scope="module")
def other_runs(cache_dir, tmp_path_factory):
    """Two more 5-step runs: another seed (same shapes, another lineage), and 8-wide tables."""
    short = ["trainer.max_steps=5"]
    return {
        "seed": _train(cache_dir, tmp_path_factory.mktemp("other_seed"), *short, "trainer.seed=1"),
        "shape": _train(cache_dir, tmp_path_factory.mktemp("other_shape"), *short, "sparse.embedding_dim=8"),
    }


def _cli(base: Path, deltas: Path, out: Path, capsys, caplog) -> tuple[int, list[str], str]:
    """``apply``'s exit status, its error lines and its warnings."""
    code = main(["apply", "--base", str(base), "--deltas", str(deltas), "--out", str(out)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    return code, errors, err + caplog.text


def test_apply_refuses_a_checkpoint_of_another_run(sharded_run, other_runs, tmp_path, capsys, caplog):
    """Another seed's checkpoint has the same shapes (the old apply patched it without a word): refused
    in one line naming the delta and the base with their lineages and steps."""
    base = other_runs["seed"] / "checkpoints" / "step_000000005"
    code, errors, _ = _cli(base, sharded_run / "deltas", tmp_path / "out", capsys, caplog)
    ours, theirs = _lineage(sharded_run / "checkpoints" / "step_000000005"), _lineage(base)
    assert ours != theirs
    assert code == 1 and not (tmp_path / "out").exists()
    assert errors == [
        f"Error in the delta chain: delta {sharded_run / 'deltas' / '000001'} follows lineage {ours}@step 5, "
        f"base checkpoint {base} is lineage {theirs}@step 5: apply it to a checkpoint of the same run"
    ]


def test_apply_refuses_a_base_of_other_shapes(sharded_run, other_runs, tmp_path, capsys, caplog):
    """8-wide tables under 32-wide deltas (the old apply died with an IndexError from index_copy_). Of
    another run, the lineage tells; with deltas written before lineages existed, the shapes tell, with
    a warning that the lineage is unknown."""
    base = other_runs["shape"] / "checkpoints" / "step_000000005"
    code, errors, _ = _cli(base, sharded_run / "deltas", tmp_path / "out1", capsys, caplog)
    assert code == 1 and len(errors) == 1 and f"base checkpoint {base} is lineage" in errors[0]
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [0, 1, 2, 3])
    for m in read_chain(deltas):  # as written before deltas recorded a lineage
        del m["lineage"]
        (deltas / f"{m['seq']:06d}" / "manifest.json").write_text(json.dumps(m))
    code, errors, output = _cli(base, deltas, tmp_path / "out2", capsys, caplog)
    assert code == 1 and not (tmp_path / "out2").exists()
    assert len(errors) == 1 and re.fullmatch(
        rf"Error in the delta chain: delta {deltas / '000001'} follows lineage <unknown>@step 5 and has table "
        rf"\w+ of shape \[\d+, 32\], base checkpoint {base} is lineage \w+@step 5 and has \[\d+, 8\]: the base and "
        "the deltas are of different models; apply them to a checkpoint of the run that wrote them",
        errors[0],
    ), errors
    assert f"delta {deltas / '000001'} has no lineage id" in output
    # The same base under a table of other rows, in apply_chain itself (same lineage: the shapes tell).
    state, step = load_checkpoint_state(sharded_run / "checkpoints" / "step_000000010")
    key = "model.sparse.ec.embeddings.t_hist_item.weight"
    state[key] = state[key][:100].clone()
    with pytest.raises(DeltaChainError, match=r"table t_hist_item of shape \[\d+, 32\], .* and has \[100, 32\]"):
        apply_chain(state, step, sharded_run / "deltas")


def test_deltas_without_lineage_still_apply_with_a_warning(sharded_run, tmp_path, capsys, caplog):
    """Old deltas (no lineage) on a checkpoint of the same shapes: applied, with a warning."""
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [2, 3])
    for m in read_chain(deltas):
        del m["lineage"]
        (deltas / f"{m['seq']:06d}" / "manifest.json").write_text(json.dumps(m))
    base = sharded_run / "checkpoints" / "step_000000010"
    code, errors, output = _cli(base, deltas, tmp_path / "out", capsys, caplog)
    assert code == 0 and not errors and "has no lineage id" in output
    final = _state(sharded_run / "checkpoints" / "step_000000020", tmp_path)
    _assert_same(_state(tmp_path / "out", tmp_path), final, ("model.",))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda m: '{"format": "gem-delta/1", "seq": 1,', "it is not valid JSON (Expecting property name"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "step"}), "no key step"),
        (lambda m: json.dumps({**m, "tables": {"t_ad_id": {"key": "x"}}}), "no key tables.t_ad_id.rows, "),
        (lambda m: json.dumps({**m, "base_step": "5"}), 'base_step is "5", not int'),
    ],
    ids=["invalid_json", "missing_key", "missing_table_key", "wrong_type"],
)
def test_a_damaged_manifest_names_the_file_and_the_problem(sharded_run, tmp_path, capsys, caplog, damage, problem):
    deltas = _copy_deltas(sharded_run, tmp_path / "d", [0, 1, 2])
    manifest = deltas / "000001" / "manifest.json"
    manifest.write_text(damage(json.loads(manifest.read_text())))
    with pytest.raises(DeltaChainError, match=re.escape(f"delta manifest {manifest} is damaged: {problem}")):
        read_chain(deltas)
    code, errors, _ = _cli(sharded_run / "checkpoints" / "step_000000000", deltas, tmp_path / "out", capsys, caplog)
    assert code == 1 and len(errors) == 1 and problem in errors[0] and "copy the delta again" in errors[0]


def test_a_damaged_base_manifest_says_so(sharded_run, tmp_path, capsys, caplog):
    base = tmp_path / "step_000000010"
    shutil.copytree(sharded_run / "checkpoints" / "step_000000010", base)
    (base / "gem_checkpoint.json").write_text("{")
    code, errors, _ = _cli(base, sharded_run / "deltas", tmp_path / "out", capsys, caplog)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"Error in the delta chain: --base {base}: {base / 'gem_checkpoint.json'} is damaged")
