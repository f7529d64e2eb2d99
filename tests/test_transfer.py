"""Knowledge transfer (gem/transfer, docs/transfer.md): shared parameters, frozen parameters, the
distillation loss, a checkpoint as an online teacher, teacher outputs exported as Parquet columns."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data.errors import DataError
from gem.train.checkpoint import CheckpointError, list_checkpoints
from gem.train.losses import multitask_bce
from tests.conftest import compose

BASE = [
    "debug=tiny",
    "data=parquet",
    "trainer.device=cpu",
    "trainer.plots=false",
    "data.batch_size=64",
    "data.num_workers=0",
]


def _data(tiny_dataset, *extra):
    return [*BASE, f"data.dir={tiny_dataset}", *extra]


@pytest.fixture(scope="module")
def teacher_ckpt(tiny_dataset, tmp_path_factory):
    """A small GEM model trained 6 steps on the tiny data set, its checkpoint written at the end."""
    from gem.train.trainer import train

    run_dir = tmp_path_factory.mktemp("teacher")
    train(
        compose(
            _data(
                tiny_dataset,
                "model=gem_tiny",
                "trainer.max_steps=6",
                "checkpoint.enabled=true",
                f"trainer.run_dir={run_dir}",
                "data.eval_batch_size=512",
            )
        )
    )
    return list_checkpoints(run_dir / "checkpoints")[-1]


def _student(tiny_dataset, *extra):
    import gem

    data = gem.build_data(compose(_data(tiny_dataset, *extra)))
    return data, gem.build_model(data)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a one-process ShardedTensor (table-wise: one shard) or a plain tensor."""
    if hasattr(t, "local_shards"):
        (shard,) = t.local_shards()
        assert list(shard.tensor.shape) == list(t.size())
        return shard.tensor
    return t


@pytest.mark.parametrize("backend", ["torchrec", "native"])
def test_shared_tables_load_bit_exact_from_the_teacher(tiny_dataset, teacher_ckpt, backend):
    from gem.train.initialize import init_from_checkpoint, model_state
    from gem.transfer.teacher import load_teacher

    data, model = _student(tiny_dataset, f"sparse={backend}", "model=dlrm")
    before = {k: _full(v).clone() for k, v in model_state(model).items()}
    loaded = init_from_checkpoint(model, teacher_ckpt, ["sparse_arch.ebc.embedding_bags.t_ad_id", "sparse_arch.ec"])
    assert (
        "sparse_arch.ebc.embedding_bags.t_ad_id.weight" in loaded
        and "sparse_arch.ec.embeddings.t_hist_item.weight" in loaded
    )
    teacher = load_teacher(teacher_ckpt, data.schema, None, torch.device("cpu")).model
    want = {f"sparse_arch.{k}": v for k, v in teacher.sparse_arch.state_dict().items()}
    after = model_state(model)
    for name, t in after.items():
        if name in loaded:
            assert torch.equal(_full(t), want[name]), name
        else:  # the rest untouched (the dense arch is a DLRM, the teacher's a GEM one)
            assert torch.equal(_full(t), before[name]), name
    assert not torch.equal(
        before["sparse_arch.ebc.embedding_bags.t_ad_id.weight"], want["sparse_arch.ebc.embedding_bags.t_ad_id.weight"]
    )


def test_init_from_of_another_shape_or_a_missing_key_names_it(tiny_dataset, teacher_ckpt):
    from gem.train.initialize import init_from_checkpoint

    _, model = _student(tiny_dataset, "sparse.embedding_dim=8")
    with pytest.raises(
        CheckpointError, match=r"t_ad_id.weight: \[80, 32\] float32 in the checkpoint, \[80, 8\] float32"
    ):
        init_from_checkpoint(model, teacher_ckpt, ["sparse_arch.ebc.embedding_bags.t_ad_id"])
    _, model = _student(tiny_dataset, "model=dlrm")
    with pytest.raises(CheckpointError, match=r"dense_arch.bottom.*not in the checkpoint"):
        init_from_checkpoint(model, teacher_ckpt, ["dense_arch.bottom"])  # a GEM teacher has no DLRM bottom MLP
    with pytest.raises(CheckpointError, match="'sparse_arch.nope' matches no tensor"):
        init_from_checkpoint(model, teacher_ckpt, ["sparse_arch.nope"])
    with pytest.raises(CheckpointError, match="does not exist"):
        init_from_checkpoint(model, teacher_ckpt.parent / "step_999", ["sparse_arch"])


@pytest.mark.parametrize("backend", ["torchrec", "native"])
def test_frozen_parameters_are_unchanged_after_steps(tiny_dataset, backend):
    import gem
    from gem.train.initialize import freeze, model_state

    frozen_prefixes = ["sparse_arch.ebc.embedding_bags.t_ad_id", "dense_arch.bottom"]
    # the config gives the sharding the frozen tables: a fused one trains at learning rate 0 in a kernel
    # group of its own
    data, model = _student(tiny_dataset, f"sparse={backend}", f"checkpoint.init_frozen=[{','.join(frozen_prefixes)}]")
    frozen = freeze(model, frozen_prefixes)
    assert "sparse_arch.ebc.embedding_bags.t_ad_id.weight" in frozen and "dense_arch.bottom.net.0.weight" in frozen
    before = {k: _full(v).clone() for k, v in model_state(model).items()}
    opt = gem.build_optimizers(model, data, 10)
    for _, batch in zip(range(4), data.loader("train")):
        opt.zero_grad()
        loss, _ = data.loss(model(batch), batch)
        loss.backward()
        opt.step()
    after = model_state(model)
    for name in before:
        same = torch.equal(before[name], _full(after[name]))
        assert same == (name in frozen), name


def test_distillation_loss_matches_a_hand_computation():
    torch.manual_seed(0)
    z, t = torch.randn(6, 2), torch.randn(6, 2)
    y = torch.randint(0, 2, (6, 2)).float()
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    w, temp = torch.tensor([0.5, 0.25]), 2.0
    loss, per_task = multitask_bce(z, y, mask, torch.tensor([1.0, 2.0]), teacher=t, distill_weight=w, temperature=temp)
    want = []
    for k in range(2):
        rows = mask[:, k]
        hard = -(
            y[rows, k] * torch.log(torch.sigmoid(z[rows, k]))
            + (1 - y[rows, k]) * torch.log(1 - torch.sigmoid(z[rows, k]))
        )
        p, q = torch.sigmoid(t[rows, k] / temp), torch.sigmoid(z[rows, k] / temp)
        soft = -(p * torch.log(q) + (1 - p) * torch.log(1 - q))
        want.append(((1 - w[k]) * hard + w[k] * temp**2 * soft).mean())
    assert torch.allclose(per_task, torch.stack(want), atol=1e-6)
    assert torch.allclose(loss, want[0] + 2 * want[1], atol=1e-6)
    # weight 0: the plain loss, and a NaN teacher column of an undistilled task is ignored
    t[:, 1] = float("nan")
    loss0, _ = multitask_bce(z, y, mask, torch.ones(2), teacher=t, distill_weight=torch.tensor([0.0, 0.0]))
    plain, _ = multitask_bce(z, y, mask, torch.ones(2))
    assert torch.equal(loss0, plain)
    assert torch.isfinite(
        multitask_bce(z, y, mask, torch.ones(2), teacher=t, distill_weight=torch.tensor([0.3, 0.0]))[0]
    )


def test_a_task_the_teacher_never_learned_is_named(tiny_dataset, teacher_ckpt):
    from gem.data.pipeline.schema import FeatureSchema
    from gem.transfer.teacher import load_teacher

    schema = FeatureSchema.from_config(
        pq.read_schema(next((tiny_dataset / "val").glob("*.parquet"))).metadata
        and __import__("json").loads(
            pq.read_schema(next((tiny_dataset / "val").glob("*.parquet"))).metadata[b"gem.schema"]
        )
    )
    with pytest.raises(CheckpointError, match=r"never learned task\(s\) \['like'\]"):
        load_teacher(teacher_ckpt, schema, ("click", "like"), torch.device("cpu"))
    # NaN teacher outputs (a broken teacher) are named too
    from gem.data.pipeline.loader import build_loader

    teacher = load_teacher(teacher_ckpt, schema, ("conversion",), torch.device("cpu"))
    with torch.no_grad():
        for p in teacher.model.dense_arch.heads.parameters():
            p.fill_(float("nan"))
    batch = next(iter(build_loader(sorted((tiny_dataset / "val").glob("*.parquet")), schema, 32)))
    with pytest.raises(FloatingPointError, match=r"\['conversion'\] logits are NaN or inf"):
        teacher.logits(batch)


def test_export_writes_teacher_columns_resumably_and_the_loader_reads_them(tiny_dataset, teacher_ckpt, tmp_path):
    from gem.data.pipeline.loader import build_loader
    from gem.transfer.export import parse, run
    from gem.transfer.teacher import load_teacher

    out = tmp_path / "out"
    args = _data(tiny_dataset) + [
        f"transfer.checkpoint={teacher_ckpt.parent}",
        f"transfer.out={out}",
        "transfer.splits=[train,val]",
        "transfer.representation=heads",
        "transfer.batch_size=128",
    ]
    cfg, overrides = parse(args)
    first = run(cfg, overrides)
    assert len(first["written"]) == 4 and not first["skipped"]  # 3 train files of <= 300 rows, 1 val file
    second = run(cfg, overrides)
    assert not second["written"] and len(second["skipped"]) == 4
    src = sorted((tiny_dataset / "val").glob("*.parquet"))[0]
    table = pq.read_table(out / "val" / src.name)
    assert table.num_rows == pq.read_metadata(src).num_rows
    assert {"teacher_click", "teacher_conversion", "teacher_repr"} <= set(table.column_names)
    assert table.schema.metadata[b"gem.schema"] == pq.read_schema(src).metadata[b"gem.schema"]
    # the columns are the teacher's logits of those rows, in order; the loader hands them out as batch.teacher
    import json

    from gem.data.pipeline.schema import FeatureSchema

    schema = FeatureSchema.from_config(json.loads(table.schema.metadata[b"gem.schema"]))
    teacher = load_teacher(teacher_ckpt, schema, None, torch.device("cpu"))
    loader = build_loader([out / "val" / src.name], schema, 1000)
    (batch,) = list(loader)
    assert torch.allclose(batch.teacher, teacher.logits(batch), atol=1e-5)
    assert torch.equal(batch.teacher[:, 0], torch.from_numpy(table.column("teacher_click").to_numpy()))


def test_non_finite_teacher_columns_are_a_data_error(tiny_dataset, tmp_path):
    import json

    from gem.data.format.checks import check_rows
    from gem.data.pipeline.loader import build_loader
    from gem.data.pipeline.schema import FeatureSchema

    src = sorted((tiny_dataset / "val").glob("*.parquet"))[0]
    table = pq.read_table(src)
    logits = np.zeros(table.num_rows, np.float32)
    logits[7] = np.nan
    table = table.append_column("teacher_click", pa.array(logits))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    schema = FeatureSchema.from_config(json.loads(table.schema.metadata[b"gem.schema"]))
    with pytest.raises(DataError, match=r"teacher_click.*NaN or inf teacher logit"):
        list(build_loader([bad], schema, 64))
    with pytest.raises(DataError, match=r"row 7.*teacher_click"):
        check_rows(pq.read_table(bad), schema, str(bad))
    # a file without teacher columns: no batch.teacher; with only some tasks: NaN for the others
    batch = next(iter(build_loader([src], schema, 64)))
    assert batch.teacher is None
    logits[7] = 1.0
    table = table.drop_columns(["teacher_click"]).append_column("teacher_click", pa.array(logits))
    pq.write_table(table, bad)
    batch = next(iter(build_loader([bad], schema, 64)))
    assert batch.teacher.shape[1] == 2 and torch.isnan(batch.teacher[:, 1]).all()


def test_a_fused_table_frozen_without_its_own_kernel_group_is_refused(tiny_dataset):
    from gem.train.initialize import freeze

    _, model = _student(tiny_dataset)  # built without checkpoint.init_frozen: t_ad_id shares its FBGEMM kernel
    with pytest.raises(CheckpointError, match="share one FBGEMM kernel"):
        freeze(model, ["sparse_arch.ebc.embedding_bags.t_ad_id"])


def test_the_teacher_runs_on_the_runs_kernel_settings(tiny_dataset, teacher_ckpt):
    """The online teacher's attention modules take the run's kernel settings, as the student's do."""
    from gem.models.sequence import ATTENTION_MODULES
    from gem.train.config import validate
    from gem.transfer.student import attach_teacher

    extra = ("model=dlrm", "kernels.store_ds=false", "trainer.distill.source=model")
    config = validate(compose(_data(tiny_dataset, *extra, f"trainer.distill.checkpoint={teacher_ckpt}")))
    data, model = _student(tiny_dataset, *extra, f"trainer.distill.checkpoint={teacher_ckpt}")
    teacher, handle = attach_teacher(config, data.schema, model, torch.device("cpu"))
    handle.remove()
    modules = [m for m in teacher.model.modules() if isinstance(m, ATTENTION_MODULES)]
    assert modules and all(m.kernel_settings.store_ds is False for m in modules)


def test_train_a_student_with_shared_frozen_tables_and_an_online_teacher(tiny_dataset, teacher_ckpt, tmp_path):
    from gem.train.trainer import train

    shared = "sparse_arch.ebc.embedding_bags.t_ad_id"
    run_dir = tmp_path / "student"
    args = _data(
        tiny_dataset,
        "model=dlrm",
        "trainer.max_steps=4",
        f"trainer.run_dir={run_dir}",
        f"checkpoint.init_from={teacher_ckpt}",
        f"checkpoint.init_modules=[{shared},sparse_arch.ec]",
        f"checkpoint.init_frozen=[{shared}]",
        "checkpoint.enabled=true",
        "trainer.distill.weight=0.5",
        "trainer.distill.temperature=2",
        "trainer.distill.source=model",
        f"trainer.distill.checkpoint={teacher_ckpt}",
    )
    result = train(compose(args))
    assert np.isfinite(result["click/auc"])
    import torch.distributed.checkpoint as dcp

    def table(path, name):
        from gem.train.initialize import manifest_shapes

        shape = manifest_shapes(path)[f"model.sparse.{name}"][0]
        out = {f"model.sparse.{name}": torch.zeros(shape)}
        dcp.load(out, checkpoint_id=str(path))
        return out[f"model.sparse.{name}"]

    mine = list_checkpoints(run_dir / "checkpoints")[-1]
    assert torch.equal(
        table(mine, "ebc.embedding_bags.t_ad_id.weight"), table(teacher_ckpt, "ebc.embedding_bags.t_ad_id.weight")
    )
    # shared but trained on: moved away from the teacher's values
    assert not torch.equal(
        table(mine, "ec.embeddings.t_hist_item.weight"), table(teacher_ckpt, "ec.embeddings.t_hist_item.weight")
    )


def test_distillation_from_data_without_teacher_columns_names_them(tiny_dataset, tmp_path):
    from gem.train.trainer import train

    with pytest.raises(DataError, match=r"has no column\(s\) \['teacher_click'\].*gem.transfer.export"):
        train(
            compose(
                _data(
                    tiny_dataset,
                    "trainer.max_steps=1",
                    f"trainer.run_dir={tmp_path}",
                    "trainer.distill.weight=0.5",
                    "trainer.distill.tasks=[click]",
                )
            )
        )


def test_synthetic_drift_moves_the_world_and_zero_is_the_default(tiny_schema):
    from gem.data.sources.synthetic import SyntheticConfig, generate

    base = generate(tiny_schema, 300, 1, SyntheticConfig(num_clusters=5), world_seed=3)
    assert base.equals(generate(tiny_schema, 300, 1, SyntheticConfig(num_clusters=5, drift=0.0), world_seed=3))
    later = generate(tiny_schema, 300, 1, SyntheticConfig(num_clusters=5, drift=0.5), world_seed=3)
    assert later.schema == base.schema and not later.column("ad_id").equals(base.column("ad_id"))


def test_resuming_the_runs_own_checkpoint_takes_precedence_over_init_from(tiny_dataset, teacher_ckpt, tmp_path):
    from gem.train.config import validate
    from gem.train.initialize import model_state
    from gem.train.setup import initialize as apply_transfer

    _, model = _student(tiny_dataset, "checkpoint.enabled=true")  # (build_model would apply init_from itself)
    config = validate(
        compose(
            _data(
                tiny_dataset,
                "checkpoint.enabled=true",
                f"checkpoint.init_from={teacher_ckpt}",
                "checkpoint.init_modules=[sparse_arch]",
            )
        )
    )
    before = {k: _full(v).clone() for k, v in model_state(model).items()}
    (tmp_path / "step_000000004").mkdir()  # the run's own checkpoint: the restore loads every tensor from it
    apply_transfer(config, model, tmp_path)
    assert all(torch.equal(before[k], _full(v)) for k, v in model_state(model).items())
    apply_transfer(config, model, tmp_path / "empty")  # nothing to resume: the teacher's tables
    assert not torch.equal(
        before["sparse_arch.ec.embeddings.t_hist_item.weight"],
        _full(model_state(model)["sparse_arch.ec.embeddings.t_hist_item.weight"]),
    )


# -- representation transfer and the adapter (gem.transfer.student) --------------------------------


@pytest.fixture(scope="module")
def exported(tiny_dataset, teacher_ckpt, tmp_path_factory):
    """The tiny data set with the teacher's logits and representation as columns, every split."""
    from gem.transfer.export import parse, run

    out = tmp_path_factory.mktemp("exported")
    run(
        *parse(
            _data(
                tiny_dataset,
                f"transfer.checkpoint={teacher_ckpt}",
                f"transfer.out={out}",
                "transfer.representation=heads",
            )
        )
    )
    return out


def _batch(directory, schema, split="val", rows=64):
    from gem.data.pipeline.loader import build_loader

    return next(iter(build_loader(sorted((directory / split).glob("*.parquet")), schema, rows)))


def test_exported_representation_is_the_teachers_own(exported, teacher_ckpt):
    import json

    from gem.data.pipeline.schema import FeatureSchema
    from gem.transfer.teacher import load_teacher

    src = sorted((exported / "val").glob("*.parquet"))[0]
    table = pq.read_table(src)
    schema = FeatureSchema.from_config(json.loads(table.schema.metadata[b"gem.schema"]))
    batch = _batch(exported, schema, rows=1000)
    assert batch.teacher_repr is not None and batch.teacher_repr.shape == (table.num_rows, 32)  # gem_tiny top_mlp[-1]
    teacher = load_teacher(teacher_ckpt, schema, None, torch.device("cpu"))
    direct = teacher(batch)[1]  # the input of the teacher's heads, computed here
    assert torch.allclose(batch.teacher_repr, direct, atol=1e-5)
    # and the column is that tensor row by row
    column = np.stack(table.column("teacher_repr").to_numpy(zero_copy_only=False))
    assert np.array_equal(column, batch.teacher_repr.numpy())
    from gem.transfer.student import teacher_representation_dim

    assert teacher_representation_dim(str(teacher_ckpt), schema) == 32  # what the online path tells a student


def _student_on(exported, *extra):
    return _student(exported, "model=dlrm", *extra)


def test_a_student_reads_the_teachers_representation(exported):
    data, model = _student_on(exported, "trainer.distill.representation=8")
    dense = model.dense_arch
    assert dense.project.in_features == 32 and dense.student.bottom.net[0].in_features == data.schema.num_dense + 8
    batch = _batch(exported, data.schema)
    loss, _ = data.loss(model(batch), batch)
    loss.backward()
    assert dense.project.weight.grad is not None and dense.project.weight.grad.abs().sum() > 0
    # the output depends on the representation: another one gives other logits
    with torch.no_grad():
        before = model(batch)
        batch.teacher_repr = batch.teacher_repr.flip(0)
        assert not torch.allclose(before, model(batch))
        batch.teacher_repr = None
    with pytest.raises(DataError, match=r"teacher representation of width 32, the batch has none"):
        model(batch)


def test_the_adapter_starts_as_the_teacher_and_trains_its_own_parameters(exported):
    import gem

    data, model = _student_on(exported, "trainer.distill.adapter=true")
    batch = _batch(exported, data.schema)
    with torch.no_grad():
        assert torch.allclose(model(batch), batch.teacher, atol=1e-6)  # gate 0, scale 1: the teacher's logits
    dense = model.dense_arch
    before = {n: p.detach().clone() for n, p in dense.named_parameters()}
    opt = gem.build_optimizers(model, data, 10)
    for _, b in zip(range(3), data.loader("train")):
        opt.zero_grad()
        data.loss(model(b), b)[0].backward()
        opt.step()
    moved = {n for n, p in dense.named_parameters() if not torch.equal(p, before[n])}
    assert {"teacher_scale", "student_gate", "student.top.net.0.weight"} <= moved
    # the student's logits are no longer the teacher's
    with torch.no_grad():
        assert not torch.allclose(model(batch), batch.teacher, atol=1e-3)


CANDIDATE = "transfer.candidate_features=[ad_id,ad_cluster]"


def _export_history(data_dir, teacher_ckpt, out, *extra):
    from gem.transfer.export import parse, run

    args = [f"transfer.checkpoint={teacher_ckpt}", f"transfer.out={out}", "transfer.representation=history"]
    return run(*parse(_data(data_dir, *args, CANDIDATE, *extra)))


@pytest.fixture(scope="module")
def exported_history(tiny_dataset, teacher_ckpt, tmp_path_factory):
    """The tiny data set with the teacher's logits and its history representation, every split."""
    out = tmp_path_factory.mktemp("exported_history")
    _export_history(tiny_dataset, teacher_ckpt, out)
    return out


def _other_candidates(src, dst):
    """A copy of the data set ``src`` in which every row has the next row's candidate (ad_id, ad_cluster)."""
    for f in sorted(src.rglob("*.parquet")):
        table = pq.read_table(f)
        for name in ("ad_id", "ad_cluster"):
            i = table.column_names.index(name)
            column = table.column(name).combine_chunks()
            table = table.set_column(i, table.field(name), pa.concat_arrays([column[1:], column[:1]]))
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
    return dst


def test_history_representation_is_the_same_for_every_candidate_and_differs_between_users(
    tiny_dataset, exported_history, teacher_ckpt, tmp_path
):
    from gem.transfer.student import representation_kind
    from gem.transfer.teacher import load_teacher

    other = _other_candidates(tiny_dataset, tmp_path / "other_candidates")
    done = _export_history(other, teacher_ckpt, tmp_path / "out", "transfer.splits=[val]")
    (written,) = done["written"]
    a, b = pq.read_table(exported_history / "val" / "part-00000.parquet"), pq.read_table(written)
    assert not np.array_equal(a.column("ad_id").to_numpy(), b.column("ad_id").to_numpy())
    # the same users and histories with other candidates: the teacher scores them differently ...
    assert not np.allclose(a.column("teacher_click").to_numpy(), b.column("teacher_click").to_numpy(), atol=1e-3)
    rep_a, rep_b = (np.stack(t.column("teacher_repr").to_numpy(zero_copy_only=False)) for t in (a, b))
    assert rep_a.shape == (a.num_rows, 16 * 6)  # gem_tiny: dim 16 x (2 CLS + 2 PMA + 2 recent) summary tokens
    assert np.array_equal(rep_a, rep_b)  # ... and gives them the same history vector
    # while the head input (per candidate) changes with the candidate
    schema = _schema_of(tiny_dataset)
    teacher = load_teacher(teacher_ckpt, schema, None, torch.device("cpu"))
    heads_a, heads_b = (teacher(_batch(d, schema, rows=1000))[1] for d in (exported_history, other))
    assert not torch.allclose(heads_a, heads_b, atol=1e-3)
    # other users (other histories) get other vectors
    users = np.array([u[0] for u in a.column("user_id").to_pylist()])
    differ = np.flatnonzero(users[1:] != users[:-1])
    assert len(differ) > 50 and all(np.abs(rep_a[i + 1] - rep_a[i]).max() > 1e-4 for i in differ)
    assert representation_kind(written) == {
        "kind": "history",
        "candidate_features": ["ad_id", "ad_cluster"],
        "width": 96,
    }
    # resumable like the rest: a rerun writes nothing
    again = _export_history(other, teacher_ckpt, tmp_path / "out", "transfer.splits=[val]")
    assert not again["written"] and again["skipped"] == [written]


@pytest.mark.parametrize("block", ["interformer", "kunlun"])
def test_history_pass_leaves_the_candidate_and_the_dense_features_out_of_either_block(tiny_dataset, tmp_path, block):
    from gem.transfer.teacher import Teacher

    data, model = _student(tiny_dataset, "model=gem_tiny", f"model.block={block}", "sparse.backend=native")
    teacher = Teacher(model, data.schema.tasks, data.schema.tasks, torch.device("cpu"), "test")
    other = _other_candidates(tiny_dataset, tmp_path / "other")
    a, b = _batch(tiny_dataset, data.schema), _batch(other, data.schema)
    assert torch.equal(teacher.history(a, ("ad_id", "ad_cluster")), teacher.history(b, ("ad_id", "ad_cluster")))
    assert not torch.allclose(teacher.history(a, ("ad_id",)), teacher.history(b, ("ad_id",)))  # ad_cluster tells
    b.dense = torch.randn_like(b.dense)
    assert not torch.allclose(teacher.history(a, ("ad_id", "ad_cluster")), teacher.history(b, ("ad_id", "ad_cluster")))
    assert torch.equal(
        teacher.history(a, ("ad_id", "ad_cluster", "dense")), teacher.history(b, ("ad_id", "ad_cluster", "dense"))
    )


def test_a_student_reads_the_history_representation(exported_history):
    data, model = _student_on(exported_history, "trainer.distill.representation=8")
    dense = model.dense_arch
    assert dense.project.in_features == 96
    batch = _batch(exported_history, data.schema)
    data.loss(model(batch), batch)[0].backward()
    assert dense.project.weight.grad is not None and dense.project.weight.grad.abs().sum() > 0


def test_bad_representation_settings_name_the_values(tiny_dataset, teacher_ckpt, tmp_path):
    from gem.transfer.export import parse, run

    base = _data(tiny_dataset, f"transfer.checkpoint={teacher_ckpt}", f"transfer.out={tmp_path}")
    with pytest.raises(SystemExit, match=r"representation=True must be one of \['none', 'heads', 'history'\]"):
        parse([*base, "transfer.representation=true"])
    with pytest.raises(SystemExit, match=r"history needs transfer.candidate_features=\[\.\.\.\]"):
        parse([*base, "transfer.representation=history"])
    with pytest.raises(SystemExit, match=r"candidate_features=\['ad_id'\] is read only with .*history \(not heads"):
        parse([*base, "transfer.representation=heads", "transfer.candidate_features=[ad_id]"])
    assert parse([*base, "transfer.representation=false"])[0].representation == "none"
    cfg, overrides = parse([*base, "transfer.representation=history", "transfer.candidate_features=[ad_id,hist_item]"])
    with pytest.raises(ValueError, match=r"unknown \['hist_item'\].*\['user_id', 'ad_id', 'ad_cluster', 'user_in"):
        run(cfg, overrides)


def test_online_teacher_fills_the_batch_and_stays_frozen(tiny_dataset, teacher_ckpt):
    import gem
    from gem.transfer.student import attach_teacher

    data, model = _student(
        tiny_dataset,
        "model=dlrm",
        "trainer.distill.representation=4",
        "trainer.distill.adapter=true",
        "trainer.distill.source=model",
        f"trainer.distill.checkpoint={teacher_ckpt}",
    )
    assert model.dense_arch.project.in_features == 32  # from the teacher's checkpoint
    teacher, _ = attach_teacher(data.config, data.schema, model, torch.device("cpu"))
    frozen = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    assert not any(p.requires_grad for p in teacher.parameters())
    opt = gem.build_optimizers(model, data, 10)
    assert not {id(p) for p in teacher.parameters()} & {id(p) for p in model.parameters()}
    for _, b in zip(range(3), data.loader("train")):
        assert b.teacher is None and b.teacher_repr is None  # the data set has no teacher columns
        opt.zero_grad()
        data.loss(model(b), b)[0].backward()  # the hook filled the batch before the forward
        assert b.teacher.shape == (b.batch_size, 2) and b.teacher_repr.shape == (b.batch_size, 32)
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in teacher.named_parameters())
    assert torch.allclose(b.teacher, teacher.logits(b))


def test_train_students_with_representation_and_adapter_from_data_and_online(
    tiny_dataset, exported, teacher_ckpt, tmp_path
):
    from gem.train.trainer import train

    common = ["model=dlrm", "trainer.max_steps=3", "trainer.distill.representation=4", "trainer.distill.adapter=true"]
    offline = train(
        compose(_data(exported, *common, f"trainer.run_dir={tmp_path / 'a'}", "trainer.distill.weight=0.5"))
    )
    online = train(
        compose(
            _data(
                tiny_dataset,  # no teacher columns: the online teacher provides them
                *common,
                f"trainer.run_dir={tmp_path / 'b'}",
                "trainer.distill.source=model",
                f"trainer.distill.checkpoint={teacher_ckpt}",
            )
        )
    )
    assert np.isfinite(offline["click/auc"]) and np.isfinite(online["click/auc"])


# -- bad input: each names the problem and the fix -------------------------------------------------


def _rewrite(src, dst, change, add_task=None):
    """A copy of the data set ``src`` whose ``gem.schema`` metadata ``change(meta)`` edits in place
    (``add_task``: a task's label columns added too, every label 0 and observed)."""
    import json

    for f in sorted(src.rglob("*.parquet")):
        table = pq.read_table(f)
        meta = json.loads(table.schema.metadata[b"gem.schema"])
        change(meta)
        if add_task:
            n = table.num_rows
            table = table.append_column(f"label_{add_task}", pa.array(np.zeros(n, np.float32)))
            table = table.append_column(f"label_mask_{add_task}", pa.array(np.ones(n, bool)))
            meta["tasks"].append(add_task)
        table = table.replace_schema_metadata({**table.schema.metadata, b"gem.schema": json.dumps(meta).encode()})
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
    return dst


def _schema_of(directory):
    import json

    from gem.data.pipeline.schema import FeatureSchema

    f = sorted((directory / "train").glob("*.parquet"))[0]
    return FeatureSchema.from_config(json.loads(pq.read_schema(f).metadata[b"gem.schema"]))


def test_a_teacher_of_another_schema_is_named_with_the_fix(tiny_dataset, teacher_ckpt, tmp_path):
    import shutil

    from omegaconf import OmegaConf

    from gem.transfer.teacher import load_teacher

    def wider_ads(meta):
        meta["id_features"][1]["cardinality"] = 90  # ad_id

    other = _schema_of(_rewrite(tiny_dataset, tmp_path / "other", wider_ads))
    with pytest.raises(
        CheckpointError,
        match=r"another feature schema.*: feature 'ad_id' has cardinality 80 in the teacher's, 90 in this data's; "
        r"use a teacher trained on this",
    ):
        load_teacher(teacher_ckpt, other, None, torch.device("cpu"))
    # the teacher's data set gone (its schema unknown): the tensor shapes tell
    moved = tmp_path / "ckpt" / teacher_ckpt.name
    shutil.copytree(teacher_ckpt, moved)
    cfg = OmegaConf.load(moved / "config.yaml")
    cfg.data.dir = str(tmp_path / "gone")
    OmegaConf.save(cfg, moved / "config.yaml")
    with pytest.raises(
        CheckpointError, match=r"t_ad_id.weight: \[80, 32\] in the checkpoint, \[90, 32\] for this data.*another schema"
    ):
        load_teacher(moved, other, None, torch.device("cpu"))


def test_a_schema_mismatch_shows_each_differing_entry(tiny_schema):
    """Issue 70: the message printed each differing key's whole value cut at 300 characters, so a
    difference in the last id feature (or a sequence feature) was cut off before it was shown."""
    import copy

    from gem.data.pipeline.schema import FeatureSchema
    from gem.transfer.teacher import check_inputs
    from tests.conftest import TINY_SCHEMA

    other = copy.deepcopy(TINY_SCHEMA)
    other["id_features"][-1]["cardinality"] = 7  # user_interests, the last id feature
    other["sequence_groups"][0]["features"][-1]["cardinality"] = 9  # hist_gap
    other["tasks"] = ["click"]  # tasks may differ
    with pytest.raises(CheckpointError) as e:
        check_inputs(tiny_schema, FeatureSchema.from_config(other), "transfer.checkpoint=step_000000006")
    assert str(e.value) == (
        "transfer.checkpoint=step_000000006: the teacher was trained on another feature schema than the student's "
        "data (tasks may differ, inputs may not): feature 'user_interests' has cardinality 5 in the teacher's, 7 in "
        "this data's; feature 'hist_gap' has cardinality 6 in the teacher's, 9 in this data's; use a teacher "
        "trained on this data's features, or train the student on the teacher's"
    )


def test_missing_teacher_columns_for_representation_or_adapter_are_named(tiny_dataset, tmp_path):
    from gem.train.trainer import train

    run = [*_data(tiny_dataset, "model=dlrm", "trainer.max_steps=1", f"trainer.run_dir={tmp_path}")]
    with pytest.raises(DataError, match=r"no column\(s\) \['teacher_repr'\].*transfer.representation=heads\|history"):
        train(compose([*run, "trainer.distill.representation=4"]))
    with pytest.raises(
        DataError, match=r"no column\(s\) \['teacher_click', 'teacher_conversion'\].*gem.transfer.export"
    ):
        train(compose([*run, "trainer.distill.adapter=true"]))


def test_a_bad_teacher_representation_column_is_a_data_error(tiny_dataset, tmp_path):
    from gem.data.pipeline.loader import build_loader

    src = sorted((tiny_dataset / "val").glob("*.parquet"))[0]
    table = pq.read_table(src)
    schema = _schema_of(tiny_dataset)
    rep = np.ones((table.num_rows, 4), np.float32)
    rep[5, 2] = np.nan
    column = pa.array(list(rep), pa.list_(pa.float32()))
    pq.write_table(table.append_column("teacher_repr", column), tmp_path / "nan.parquet")
    with pytest.raises(DataError, match=r"teacher_repr.*NaN or inf in the teacher representation"):
        list(build_loader([tmp_path / "nan.parquet"], schema, 64))
    ragged = [list(r) for r in np.ones((table.num_rows, 4), np.float32)]
    ragged[3] = ragged[3][:2]
    pq.write_table(
        table.append_column("teacher_repr", pa.array(ragged, pa.list_(pa.float32()))), tmp_path / "ragged.parquet"
    )
    with pytest.raises(DataError, match=r"teacher_repr.*not 4 values like the first row"):
        list(build_loader([tmp_path / "ragged.parquet"], schema, 64))


def test_a_task_the_teacher_never_learned_stops_the_student_run(tiny_dataset, teacher_ckpt, tmp_path):
    from gem.train.trainer import train

    liked = _rewrite(tiny_dataset, tmp_path / "liked", lambda meta: None, add_task="like")
    args = _data(
        liked,
        "model=dlrm",
        "trainer.max_steps=1",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.distill.adapter=true",  # corrects every task's teacher logit: needs all of them
        "trainer.distill.source=model",
        f"trainer.distill.checkpoint={teacher_ckpt}",
    )
    with pytest.raises(CheckpointError, match=r"never learned task\(s\) \['like'\].*trainer.distill.tasks"):
        train(compose(args))


def test_a_gem_student_reading_representations_counts_the_projections_flops(exported):
    from gem.models.capabilities import capabilities
    from gem.train.flops import batch_lengths, step_flops

    data, model = _student(exported, "model=gem_tiny", "trainer.distill.representation=8")
    dense = model.dense_arch
    batch = _batch(exported, data.schema)
    lengths = batch_lengths(batch, data.schema)
    inner, outer = dense.student.flops(batch.batch_size, lengths), dense.flops(batch.batch_size, lengths)
    assert outer["forward"] - inner["forward"] == 2 * batch.batch_size * 32 * 8
    assert outer["backward"] - inner["backward"] == 2 * batch.batch_size * 32 * 8
    _, dlrm = _student(exported, "model=dlrm", "trainer.distill.representation=8")
    assert capabilities(dense).counts_flops and step_flops(dense, batch, data.schema) == sum(outer.values())
    assert not capabilities(dlrm.dense_arch).counts_flops  # DLRM has no analytic count
    assert step_flops(dlrm.dense_arch, batch, data.schema) is None
