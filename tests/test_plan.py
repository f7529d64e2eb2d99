"""``python -m gem.plan``: TorchRec's planner for a cluster on one CPU, the memory per rank, the plan
file a run loads with ``sparse.plan_file``, and the step-time model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gem.plan.planner import GiB, dense_memory, host_table_memory, make_plan, table_memory
from gem.train.config import ConfigError, validate
from tests.conftest import compose
from tests.test_distributed import _errors, torchrun


def _plan(*overrides):
    return make_plan(validate(compose(["debug=tiny", *overrides])))


def test_the_trainer_uses_the_placement_of_a_plan_file(tmp_path):
    """Plan for two CPU ranks, then train on two ranks with sparse.plan_file: the logged plan is the file's."""
    from gem.distributed.sharding import format_plan, load_plan_file
    from gem.plan.__main__ import main
    from gem.sparse.arch import SparseArch
    from gem.train.config import validate as check

    path = tmp_path / "plan.json"
    overrides = ["debug=tiny", "plan.world_size=2", "plan.gpus_per_node=2", "plan.device=cpu", f"plan.out={path}"]
    assert main(overrides) == 0
    data = json.loads(path.read_text())
    assert data["cluster"]["world_size"] == 2 and data["sharding"]["world_size"] == 2
    config = check(compose(["debug=tiny"]))
    from gem.data.pipeline.schema import FeatureSchema

    arch = SparseArch.from_config(
        FeatureSchema.from_config(config.data.schema), config.sparse.embedding_dim, device="meta"
    )
    expected = format_plan(load_plan_file(str(path), arch, 2, 2, "cpu"), arch, 2)
    run_dir = tmp_path / "run"
    proc = torchrun(
        [
            "-m",
            "gem.train",
            "debug=tiny",
            f"trainer.run_dir={run_dir}",
            f"data.cache_dir={tmp_path}",
            "trainer.device=cpu",
            f"sparse.plan_file={path}",
            "trainer.max_steps=4",
            "trainer.log_every=2",
            "trainer.plots=false",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, _errors(proc.stderr)
    log = (run_dir / "train.log").read_text()
    assert f"sparse sharding plan (plan file {path}):\n{expected}" in log, log


def test_a_plan_file_for_another_world_or_model_is_refused(tmp_path):
    from gem.distributed.sharding import load_plan_file
    from gem.sparse.arch import SparseArch

    plan = _plan("plan.world_size=2", "plan.gpus_per_node=2", "plan.device=cpu")
    path = plan.save(tmp_path / "plan.json")
    arch = SparseArch.from_config(plan.schema, plan.config.sparse.embedding_dim, device="meta")
    with pytest.raises(
        ValueError,
        match=r"the plan is for 2 ranks, this run shards over 4; plan again with "
        r"plan.world_size=4",
    ):
        load_plan_file(str(path), arch, 4, 4, "cpu")
    wider = SparseArch.from_config(plan.schema, 16, device="meta")
    with pytest.raises(ValueError, match=r"table t_user_id is 2000 x 32 in the plan, 2000 x 16 in this model"):
        load_plan_file(str(path), wider, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"sparse.plan_file='/nonexistent.json' cannot be read"):
        load_plan_file("/nonexistent.json", arch, 2, 2, "cpu")


def test_a_large_cluster_is_planned_and_grouped_by_rank(tmp_path, capsys):
    from gem.plan.__main__ import main

    path = tmp_path / "plan.json"
    assert main(["debug=tiny", "model=gem_tiny", "parallelism=hsdp", "plan.world_size=64", f"plan.out={path}"]) == 0
    out = capsys.readouterr().out
    assert "plan for 64 ranks (8 nodes of 8 cuda devices, 141 GiB each)" in out
    assert "HSDP: shard over 8, replicate 8x" in out and "shards per rank:" in out and "ranks 0-" in out
    assert "predicted step time" in out and "every rank fits" in out
    data = json.loads(path.read_text())
    assert len(data["sharding"]["tables"]) == 9 and data["memory_bytes"]["total"]["max"] > 0
    assert [r["world_size"] for r in data["step_time"]["rows"]][:3] == [1, 2, 4]
    png = tmp_path / "scaling.png"  # the scaling table as a plot, beside the plan file
    assert f"scaling plot: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["debug=tiny", "plan.world_size=12"]) == 1
    assert capsys.readouterr().err.strip() == (
        "Error in the configuration: plan.world_size=12 is not a whole number "
        "of nodes of plan.gpus_per_node=8; set plan.world_size=8"
    )


def test_over_budget_ranks_are_named_with_the_fix():
    budget = ["plan.hbm_gb=0.0132", "plan.reserve_gb=0.001"]  # 12.5 MiB for ranks that need 13-15 MiB
    plan = _plan("model=gem_tiny", "plan.world_size=8", *budget)
    (warning,) = [w for w in plan.warnings if "ranks need more" in w]
    assert "8 of 8 ranks need more than the 12.5 MiB budget" in warning and "mostly activations" in warning
    assert "parallelism.activation_checkpointing=true" in warning and "data.batch_size=" in warning
    fits = int(warning.split("data.batch_size=")[1].split()[0])
    again = _plan("model=gem_tiny", "plan.world_size=8", *budget, f"data.batch_size={fits}")
    assert not again.warnings, again.warnings  # the suggested batch fits
    checkpointed = _plan("model=gem_tiny", "plan.world_size=8", "parallelism.activation_checkpointing=true")
    assert checkpointed.memory["activations"][0] < plan.memory["activations"][0]
    again = _plan("model=gem_tiny", "plan.world_size=8", *budget)  # the probe counts the same bytes every time
    assert again.memory["activations"][0] == plan.memory["activations"][0]


def test_table_and_dense_memory_formulas():
    sharding = {
        "tables": {
            "t_a": {
                "sharding_type": "row_wise",
                "rows": 10,
                "dim": 4,
                "shards": [{"rank": 0, "sizes": [5, 4]}, {"rank": 1, "sizes": [5, 4]}],
            },
            "t_b": {"sharding_type": "data_parallel", "rows": 3, "dim": 2, "shards": []},
        }
    }
    rowwise = table_memory(sharding, 2, "rowwise_adagrad")
    assert rowwise["tables"].tolist() == [4 * 20 + 4 * 6] * 2
    assert rowwise["table optimizer"].tolist() == [4 * 5 + 4 * 3] * 2  # one float per row (of each shard)
    assert rowwise["data-parallel table grads"].tolist() == [4 * 6] * 2
    assert table_memory(sharding, 2, "adam")["table optimizer"].tolist() == [8 * 20 + 8 * 6] * 2  # 2x the weights
    config = validate(compose(["debug=tiny", "parallelism=hsdp"]))
    from gem.distributed.parallel_dims import ParallelDims

    mem = dense_memory(config, 1000, [400, 400], ParallelDims(-1, -1, 16, 8), fsdp=True)
    assert mem["dense params"] == 4000 / 8 and mem["dense optimizer (AdamW)"] == 8000 / 8
    assert mem["gathered dense blocks"] == 2 * (2 * 400 + 200) + 4 * 400  # bf16: two blocks and the root


def test_tables_in_uvm_count_as_host_memory_with_their_cache_in_hbm():
    """A fused_uvm table lives in host memory; a fused_uvm_caching one there too, with TorchRec's
    planner's cache share (0.2) of its weights and optimizer state in HBM."""
    from torchrec.distributed.planner.constants import UVM_CACHING_RATIO

    def table(kernel):
        shards = [{"rank": 0, "sizes": [6, 4]}, {"rank": 1, "sizes": [4, 4]}]
        return {"sharding_type": "row_wise", "rows": 10, "dim": 4, "compute_kernel": kernel, "shards": shards}

    sharding = {
        "tables": {"t_hbm": table("fused"), "t_cached": table("fused_uvm_caching"), "t_uvm": table("fused_uvm")}
    }
    device = table_memory(sharding, 2, "rowwise_adagrad")
    host = host_table_memory(sharding, 2, "rowwise_adagrad")
    assert device["tables"].tolist() == [4 * 24, 4 * 16] and device["table optimizer"].tolist() == [4 * 6, 4 * 4]
    cache = [round(UVM_CACHING_RATIO * (4 * 24 + 4 * 6)), round(UVM_CACHING_RATIO * (4 * 16 + 4 * 4))]
    assert UVM_CACHING_RATIO == 0.2 and device["UVM table caches"].tolist() == cache
    assert host["UVM tables"].tolist() == [2 * 4 * 24, 2 * 4 * 16]  # both UVM tables, whole
    assert host["UVM table optimizer"].tolist() == [2 * 4 * 6, 2 * 4 * 4]
    assert host_table_memory({"tables": {"t_hbm": table("fused")}}, 2, "rowwise_adagrad") == {}


def test_a_plan_with_a_table_in_uvm_fits_the_budget_its_host_copy_would_break():
    """3 MiB of HBM per rank: TorchRec's planner puts t_ad_id (1.3 MB) in UVM with a cache; counting its
    host copy as HBM (as before) would put both ranks over the budget and warn."""
    plan = _plan(
        "plan.world_size=2", "plan.gpus_per_node=2", "plan.hbm_gb=0.003", "plan.reserve_gb=0", "plan.activations=none"
    )
    kernels = {name: t["compute_kernel"] for name, t in plan.sharding["tables"].items()}
    assert kernels["t_ad_id"] == "fused_uvm_caching", kernels
    host = sum(plan.host_memory.values())
    assert host.tolist() == [4 * 5000 * 32 + 4 * 5000] * 2  # row-wise halves: weights and row-wise Adagrad state
    total = plan.total()
    assert (total <= plan.budget).all() and not any("ranks need more" in w for w in plan.warnings), plan.warnings
    assert (total - plan.memory["UVM table caches"] + host > plan.budget).all()  # the old count would not fit
    report = plan.text()
    assert "host memory per rank (TorchRec's planner put t_ad_id in UVM" in report and "UVM table caches" in report
    assert plan.to_json()["host_memory_bytes"]["UVM tables"]["max"] == 4 * 5000 * 32


def test_the_step_time_model_scales_down_with_communication():
    from gem.plan.steptime import step_time_table

    plan = _plan("model=gem_tiny", "parallelism=hsdp", "data.batch_size=1024", "plan.world_size=64")
    table = step_time_table(plan)
    rows = {r.world_size: r for r in table.rows}
    assert rows[1].parts_ms["all-to-all"] == 0 and rows[1].parts_ms["fsdp exposed"] == 0
    assert rows[4096].parts_ms["all-to-all"] > rows[8].parts_ms["all-to-all"] > 0
    assert all(0 < table.efficiency(r) <= 1.0 + 1e-9 for r in table.rows)
    assert rows[4096].examples_per_s > rows[1].examples_per_s
    assert np.isclose(rows[1].parts_ms["dense"], plan.flops_per_step / (989e12 * plan.config.plan.mfu) * 1e3)
    checkpointed = _plan(
        "model=gem_tiny",
        "parallelism=hsdp",
        "data.batch_size=1024",
        "plan.world_size=64",
        "parallelism.activation_checkpointing=true",
        "plan.activations=none",
    )
    recompute = 1 + plan.forward_flops / plan.flops_per_step  # the forward runs again in backward
    assert np.isclose(step_time_table(checkpointed).rows[0].parts_ms["dense"], rows[1].parts_ms["dense"] * recompute)
    assert GiB == 2**30


def test_the_step_time_defaults_are_the_h200_calibration_and_predict_the_other_runs():
    """benchmarks/plan_model.py: the plan.* defaults (PlanConfig, their one source) are the constants
    fitted to the H200 results, and the runs they were not fitted to are predicted within 10%."""
    from gem.plan.steptime import calibrate

    fitted, checks = calibrate()
    composed = validate(compose([])).plan
    for key, value in fitted.items():
        assert getattr(composed, key) == pytest.approx(value, rel=0.02), key
    held_out = [c for c in checks if not c.fitted]
    assert len(held_out) == 4 and max(abs(c.error) for c in held_out) < 0.10, [(c.run, c.error) for c in held_out]
    assert all(abs(c.error) < 1e-6 for c in checks if c.fitted)


def test_a_parquet_data_set_gives_its_schema_and_history_lengths(tiny_dataset):
    plan = _plan(
        "data=parquet", f"data.dir={tiny_dataset}", "plan.world_size=4", "plan.gpus_per_node=4", "plan.activations=none"
    )
    assert plan.lengths.source.endswith(f"{tiny_dataset / 'train'}") and plan.schema.cardinality("ad_id") == 80
    assert 0 < plan.lengths.mean("hist") <= 12  # the tiny data set's max_len


def test_an_explicit_plan_or_a_plan_file_is_dry_run_as_training_would_build_it(tmp_path):
    common = ["plan.world_size=4", "plan.gpus_per_node=4", "plan.device=cpu", "plan.activations=none"]
    plan = _plan("sparse.sharding_type=table_wise", "+sparse.plan.t_hist_item=column_wise", *common)
    types = {name: t["sharding_type"] for name, t in plan.sharding["tables"].items()}
    assert types.pop("t_hist_item") == "column_wise" and set(types.values()) == {"table_wise"}
    assert "tables (explicit: sparse.plan / sparse.sharding_type):" in plan.text()
    with pytest.raises(ConfigError, match=r"sparse.plan.t_hist_surface=row_wise: 3 rows over 4 ranks"):
        _plan("sparse.sharding_type=row_wise", *common)
    path = plan.save(tmp_path / "plan.json")
    again = _plan(f"sparse.plan_file={path}", *common)
    assert again.sharding == plan.sharding and f"tables (plan file {path}):" in again.text()


def test_without_matplotlib_the_scaling_plot_is_skipped(tmp_path, monkeypatch, caplog):
    from gem.plan.steptime import Row, StepTimeTable, plot_scaling

    table = StepTimeTable([Row(1, {"dense": 1.0}, 8), Row(2, {"dense": 1.2}, 8)])
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_scaling(table, tmp_path / "scaling.png") is None and not (tmp_path / "scaling.png").exists()
    assert "matplotlib is not installed: no scaling plot" in caplog.text


def test_2d_sparse_parallelism_plans_a_group_and_compares_group_sizes(tmp_path, capsys):
    """sparse.sharding_group_size=4 at 16 ranks: the planner plans for 4, global rank r holds group rank
    r // 4's shards, the all-to-all spans the group, the replicas sync, and group sizes are compared."""
    from gem.plan.__main__ import main
    from gem.plan.steptime import compare_group_sizes, step_time_table, traffic

    common = ["model=gem_tiny", "plan.world_size=16", "plan.activations=none"]
    flat, grouped = _plan(*common), _plan(*common, "sparse.sharding_group_size=4")
    assert grouped.sharding["world_size"] == 4 and grouped.sharding_world == 4 and flat.sharding_world == 16
    tables = grouped.memory["tables"]
    assert tables.shape == (16,) and (tables.reshape(4, 4) == tables[::4, None]).all()  # ranks 0-3: group rank 0
    assert tables.max() > flat.memory["tables"].max()  # a quarter of the ranks hold every table
    t_flat, t_grouped = traffic(flat, 16), traffic(grouped, 16)
    assert t_grouped.group == 4 and t_flat.group == 16 and t_flat.replica_table_bytes == 0
    assert t_grouped.replica_table_bytes > 0 and t_grouped.replica_intra  # 4 replicas: consecutive ranks, one node
    assert t_grouped.a2a_intra + t_grouped.a2a_inter < t_flat.a2a_intra + t_flat.a2a_inter
    rows = {r.world_size: r for r in step_time_table(grouped).rows}
    assert rows[2].parts_ms["replica sync"] == rows[4].parts_ms["replica sync"] == 0  # no replicas below 4 ranks
    assert rows[16].parts_ms["replica sync"] > 0
    comparison = compare_group_sizes(grouped)
    assert [c.group_size for c in comparison.choices] == [4, 8, 16] and comparison.configured == 4
    assert comparison.best is not None and "recommended: sparse.sharding_group_size=" in comparison.text()
    with pytest.raises(ConfigError, match=r"sparse.sharding_group_size=3 does not divide plan.world_size=16"):
        _plan(*common, "sparse.sharding_group_size=3")
    path = tmp_path / "plan.json"
    assert main(["debug=tiny", *common, "sparse.sharding_group_size=4", "plan.device=cpu", f"plan.out={path}"]) == 0
    out = capsys.readouterr().out
    assert "tables sharded inside 4 groups of 4 ranks (group i: ranks i, i+4, i+8, ...)" in out
    assert "shards per rank of a group:" in out and "2-D sparse parallelism at 16 GPUs" in out
    data = json.loads(path.read_text())
    assert data["cluster"]["sharding_group_size"] == 4 and data["sharding"]["world_size"] == 4
    assert data["sharding_groups"]["recommended"] in (4, 8, 16)
    from gem.distributed.sharding import load_plan_file
    from gem.sparse.arch import SparseArch

    arch = SparseArch.from_config(grouped.schema, grouped.config.sparse.embedding_dim, device="meta")
    load_plan_file(str(path), arch, 4, 4, "cpu")  # what training loads for a group of 4 ranks
