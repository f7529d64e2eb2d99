"""Sharded training == one process on the global batch (TorchRec plans, FSDP2, HSDP), under torchrun.

Tolerance: every loss is fp32 and the sharded run computes the same sums in a different order
(per-rank partial sums, all-to-all of pooled embeddings, all-reduce / reduce-scatter of gradients,
the global-count all-reduce of the loss), so only rounding differs: measured at most 1.3e-7
relative (one fp32 ulp) over 10 steps on CPU with 2 ranks; ``rel=1e-5`` leaves ~80x headroom.
Adam and Adagrad are almost blind to a constant gradient scale (a sum where a mean belongs), so
the first step's dense gradient norm is compared too, to the same tolerance.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from gem.distributed import ParallelDims, ParallelLayoutError
from tests.conftest import ROOT, fbgemm_cuda
from tests.distributed_worker import run_case

PER_RANK_BATCH = 16
TIMEOUT_S = 300  # the whole torchrun; the workers' own collective timeout is 120 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``torchrun --standalone``-like launch on a free port; torchrun stops every rank when one fails."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _errors(stderr: str) -> str:
    """Every rank's exception lines (the first failing rank's is the cause), then the tail."""
    lines = [line for line in stderr.splitlines() if "Error" in line or "Exception" in line]
    return "\n".join(lines[:40]) + "\n...\n" + stderr[-3000:]


@cache
def _reference(data_dir: str, optimizer: str, global_batch: int) -> dict:
    return run_case({"optimizer": optimizer}, Path(data_dir), global_batch, 1, torch.device("cpu"))


class TestShardedParity:
    """One body for every backend (TorchRec's test_model_parallel_nccl pattern): gloo on CPU here,
    nccl on GPUs in the subclass below."""

    backend = "gloo"
    mesh_plan = "row_wise"  # the table plan of the dense-layout tests (None: native tables with DDP)

    def _check(self, cases: list[dict], data_dir: Path, tmp_path: Path, nproc: int = 2) -> None:
        out = tmp_path / "losses.json"
        proc = torchrun(
            [
                "tests/distributed_worker.py",
                "--data",
                str(data_dir),
                "--out",
                str(out),
                "--backend",
                self.backend,
                "--batch",
                str(PER_RANK_BATCH),
                "--cases",
                json.dumps(cases),
            ],
            nproc,
        )
        assert proc.returncode == 0, _errors(proc.stderr)
        got = json.loads(out.read_text())
        for case in cases:
            expected = _reference(str(data_dir), case.get("optimizer", "rowwise_adagrad"), PER_RANK_BATCH * nproc)
            assert max(expected["losses"]) - min(expected["losses"]) > 1e-2, "the reference does not train"
            assert got[case["name"]]["losses"] == pytest.approx(expected["losses"], rel=1e-5), case
            assert got[case["name"]]["dense_grad_norm"] == pytest.approx(expected["dense_grad_norm"], rel=1e-5), case

    def test_each_sharding_type_with_fsdp_matches_one_process(self, tiny_dataset, tmp_path):
        """Every table sharded one way, the dense arch FSDP2-sharded over both ranks (1-D mesh)."""
        self._check(
            [
                {"name": "table_wise", "plan": "table_wise", "mesh": [1, 2]},
                {"name": "row_wise", "plan": "row_wise", "mesh": [1, 2]},
                {"name": "row_wise_gathered", "plan": "row_wise", "mesh": [1, 2], "reshard_after_forward": False},
                # Row-wise Adagrad keeps one accumulator per row *per column shard* in TorchRec / FBGEMM,
                # so column-wise sharding changes that optimizer; element-wise Adagrad is exact.
                {"name": "column_wise", "plan": "column_wise", "mesh": [1, 2], "optimizer": "adagrad"},
                # TorchRec shards sequence tables (EmbeddingCollection) neither table-row-wise nor (on
                # CPU) data-parallel: those cases shard the pooled tables that way, the sequence ones otherwise.
                {
                    "name": "table_row_wise",
                    "plan": {"pooled": "table_row_wise", "sequence": "row_wise"},
                    "mesh": [1, 2],
                },
                {
                    "name": "data_parallel",
                    "plan": {"pooled": "data_parallel", "sequence": "table_wise"},
                    "mesh": [1, 2],
                },
            ],
            tiny_dataset,
            tmp_path,
        )

    def test_hsdp_meshes_match_one_process(self, tiny_dataset, tmp_path):
        """HSDP on 2-D meshes (dp_replicate, dp_shard) = (2, 1) and (1, 2)."""
        self._check(
            [
                {"name": "hsdp_2x1", "plan": self.mesh_plan, "mesh": [2, 1]},
                {"name": "hsdp_1x2", "plan": self.mesh_plan, "mesh": [1, 2], "force_2d": True},
            ],
            tiny_dataset,
            tmp_path,
        )

    def test_hsdp_2x2_on_four_ranks_matches_one_process(self, tiny_dataset, tmp_path):
        if torch.cuda.is_available() and torch.cuda.device_count() < 4:
            pytest.skip("needs four GPUs")
        # Table-wise here: row-wise over 4 ranks leaves the tiny test tables (2 rows) with empty shards,
        # on which FBGEMM's CPU row-wise Adagrad fails now and then (seen: "more than 2B rows").
        plan = "table_wise" if self.mesh_plan == "row_wise" else self.mesh_plan
        self._check([{"name": "hsdp_2x2", "plan": plan, "mesh": [2, 2]}], tiny_dataset, tmp_path, nproc=4)


@pytest.mark.multigpu
class TestShardedParityNccl(TestShardedParity):
    """The same bodies over NCCL on GPUs. TorchRec's sharded tables need the CUDA fbgemm-gpu build;
    without it the sharding-type test skips and the dense-layout tests use native tables with DDP."""

    backend = "nccl"
    mesh_plan = "row_wise" if fbgemm_cuda() else None

    def test_each_sharding_type_with_fsdp_matches_one_process(self, tiny_dataset, tmp_path):
        if not fbgemm_cuda():
            pytest.skip("TorchRec's sharded GPU kernels need the CUDA fbgemm-gpu build")
        super().test_each_sharding_type_with_fsdp_matches_one_process(tiny_dataset, tmp_path)


@pytest.mark.parametrize(
    "replicate, shard, world, message",
    [
        (3, -1, 2, r"parallelism.dp_replicate=3 does not divide the world size 2"),
        (2, 2, 2, r"dp_replicate x parallelism.dp_shard = 2 x 2 = 4, but the world size is 2"),
        (0, 1, 2, r"parallelism.dp_replicate=0: must be >= 1"),
        (-1, -1, 6, r"world_size 6 is not a whole number of nodes of 4 ranks"),
    ],
)
def test_impossible_layouts_fail_clearly(replicate, shard, world, message):
    with pytest.raises(ParallelLayoutError, match=message):
        ParallelDims(replicate, shard, world, local_world_size=4)


def test_layouts_resolve():
    assert (ParallelDims(-1, -1, 8, local_world_size=4).dp_replicate, ParallelDims(-1, -1, 8, 4).dp_shard) == (2, 4)
    assert ParallelDims(1, -1, 2).dp_shard == 2 and ParallelDims(-1, 1, 2).dp_replicate == 2
    assert ParallelDims(2, 2, 4).hsdp and not ParallelDims(1, 4, 4).hsdp


def test_parallelize_gem_wraps_dense_blocks_only_and_checkpointing_changes_no_number(tiny_dataset):
    from torch import nn
    from torch.distributed._composable.contract import _get_registry

    from gem.distributed.parallelize import dense_blocks, parallelize_gem

    model = nn.Module()
    model.sparse_arch = nn.EmbeddingBag(10, 4)
    model.dense_arch = nn.Module()
    model.dense_arch.mlp = nn.Linear(4, 4)
    model.dense_arch.project = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Identity()})
    parallelize_gem(model, None, activation_checkpointing=True)
    blocks = dense_blocks(model.dense_arch)
    assert blocks == [model.dense_arch.mlp, model.dense_arch.project["a"]]
    assert all("checkpoint" in _get_registry(b) for b in blocks) and _get_registry(model.sparse_arch) is None
    with_ac = run_case({"activation_checkpointing": True}, tiny_dataset, 32, 1, torch.device("cpu"))
    assert with_ac == _reference(str(tiny_dataset), "rowwise_adagrad", 32)


@pytest.mark.parametrize("scope", ["blocks", "dense_arch"])
def test_parallelize_gem_hands_inductor_options_to_every_compile(scope, monkeypatch):
    from torch import nn

    from gem.distributed.parallelize import parallelize_gem

    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda m, **kw: calls.append((m, kw)))
    model = nn.Module()
    model.sparse_arch = nn.EmbeddingBag(10, 4)
    model.dense_arch = nn.Module()
    model.dense_arch.mlp = nn.Linear(4, 4)
    model.dense_arch.head = nn.Linear(4, 1)
    options = {"combo_kernels": True}
    # (without the in-place scatter pass, which joins the options: tests/test_inductor_passes.py)
    parallelize_gem(model, None, compile=True, compile_scope=scope, compile_options=options, scatter_in_place=False)
    compiled = [m for m, _ in calls]
    assert compiled == ([model.dense_arch] if scope == "dense_arch" else [model.dense_arch.mlp, model.dense_arch.head])
    assert all(kw == {"options": options} for _, kw in calls)


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_decides_whether_blocks_stay_gathered_until_backward(reshard, one_rank_group):
    """FSDP2 swaps a block's sharded DTensor parameters for gathered tensors in forward; with
    reshard_after_forward=False they stay gathered until the block's backward."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from gem.distributed.parallelize import parallelize_gem

    model = nn.Module()
    model.dense_arch = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    parallelize_gem(model, init_device_mesh("cpu", (1,)), param_dtype=torch.float32, reshard_after_forward=reshard)
    block = model.dense_arch[0]
    assert isinstance(block.weight, DTensor)
    loss = model.dense_arch(torch.randn(3, 4)).sum()
    assert isinstance(block.weight, DTensor) == reshard
    loss.backward()
    assert isinstance(block.weight, DTensor) and block.weight.grad is not None


def test_trainer_with_an_impossible_mesh_fails_on_every_rank_without_hanging(tiny_dataset, tmp_path):
    proc = torchrun(
        [
            "-m",
            "gem.train",
            "debug=tiny",
            f"trainer.run_dir={tmp_path}",
            f"data.cache_dir={tmp_path}",
            "trainer.device=cpu",
            "parallelism.dp_replicate=2",
            "parallelism.dp_shard=2",
        ],
        nproc=2,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "dp_replicate x parallelism.dp_shard = 2 x 2 = 4, but the world size is 2" in proc.stderr


def test_trainer_under_torchrun_with_a_per_table_plan_and_the_sparse_dist_pipeline(tiny_dataset, tmp_path):
    """The trainer end to end on two ranks: an explicit per-table plan (printed), FSDP2, and TorchRec's
    TrainPipelineSparseDist (forced on CPU) giving the same losses as the plain loop, across an epoch
    boundary (15 steps per epoch) and a mid-training evaluation (the pipeline detaches for it). The
    plain loop's run also keeps its best validation's weights (trainer.best_metric: a collective DCP
    save of the sharded tables, loaded back before the test) and tests those."""
    plan = [
        "+sparse.plan.t_user_id=row_wise",
        "+sparse.plan.t_ad_id=table_wise:1",
        "+sparse.plan.t_hist_item=column_wise",
    ]
    losses, tests = {}, {}
    for pipeline in (True, False):
        run_dir = tmp_path / f"pipeline_{pipeline}"
        proc = torchrun(
            [
                "-m",
                "gem.train",
                "debug=tiny",
                f"trainer.run_dir={run_dir}",
                f"data.cache_dir={tmp_path}",
                "trainer.device=cpu",
                "sparse.sharding_type=table_wise",
                *plan,
                f"sparse.pipeline={pipeline}",
                "trainer.log_every=2",
                "trainer.eval_every=5",
                "trainer.eval_max_batches=1",
                *([] if pipeline else ["trainer.best_metric=click/auc", "trainer.best_mode=min"]),
            ],
            nproc=2,
        )
        assert proc.returncode == 0, _errors(proc.stderr)
        log = (run_dir / "train.log").read_text()
        assert (
            f"training pipeline (input all-to-all of batch i+1 overlaps dense compute of batch i): "
            f"{'active' if pipeline else 'off'}" in log
        )
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[pipeline] = [r["loss"] for r in metrics if r["kind"] == "train"]
        tests[pipeline] = metrics[-1]
    val = {r["step"]: r["click/auc"] for r in metrics if r["kind"] == "val"}
    best = min(val, key=val.get)
    assert tests[False]["best_step"] == best < 20 and tests[False]["best_val/click/auc"] == val[best]
    assert json.loads((run_dir / "best" / "best.json").read_text())["step"] == best
    assert tests[False]["click/auc"] != tests[True]["click/auc"]  # the best weights, not the last step's
    assert "sparse sharding plan (explicit)" in log and "FSDP over 2 ranks" in log
    rows = {line.split()[0]: line.split() for line in log.splitlines() if line.startswith("t_")}
    assert rows["t_user_id"][3] == "row_wise" and rows["t_ad_id"][3:5] == ["table_wise", "1"], log
    assert rows["t_hist_item"][3:5] == ["column_wise", "0,1"] and rows["t_hist_gap"][3] == "table_wise"
    assert len(losses[False]) == 10 and sum(losses[False][-3:]) < sum(losses[False][:3]), losses
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)


@pytest.mark.multigpu
def test_trainer_on_two_gpus_with_native_tables_and_bf16_fsdp(tmp_path):
    """What runs on GPUs without the CUDA fbgemm-gpu build: native tables (DDP), FSDP2 bf16 dense."""
    proc = torchrun(
        [
            "-m",
            "gem.train",
            "debug=tiny",
            f"trainer.run_dir={tmp_path}",
            f"data.cache_dir={tmp_path}",
            "trainer.device=cuda",
            "sparse=native",
            "parallelism=fsdp",
            "trainer.log_every=2",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    log = (tmp_path / "train.log").read_text()
    assert "FSDP over 2 ranks" in log and "compute bfloat16" in log
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_explicit_plans_check_their_tables_and_print_bytes_per_rank(tiny_schema):
    from gem.distributed.sharding import explicit_plan, format_plan
    from gem.sparse.arch import SparseArch

    arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
    names = [t.name for t in arch.tables]
    with pytest.raises(ValueError, match=r"sparse.plan: unknown table\(s\) \['t_nope'\]"):
        explicit_plan(arch, dict.fromkeys(names, "row_wise") | {"t_nope": "row_wise"}, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"no sharding for table\(s\) \['t_hist_gap'\]"):
        explicit_plan(arch, {n: "row_wise" for n in names if n != "t_hist_gap"}, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"sparse.plan.t_hist_item=table_row_wise: TorchRec shards sequence tables"):
        explicit_plan(arch, dict.fromkeys(names, "table_row_wise"), 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"sparse.plan.t_user_id='table_wise:5': rank 5 is outside \[0, 2\)"):
        explicit_plan(arch, dict.fromkeys(names, "row_wise") | {"t_user_id": "table_wise:5"}, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"sparse.plan.t_user_id='diagonal': the sharding must be one of"):
        explicit_plan(arch, dict.fromkeys(names, "row_wise") | {"t_user_id": "diagonal"}, 2, 2, "cpu")
    small = min(arch.tables, key=lambda t: t.num_embeddings)  # fewer rows than 4 ranks: empty shards
    with pytest.raises(
        ValueError,
        match=rf"sparse.plan.{small.name}=row_wise: {small.num_embeddings} rows over 4 "
        r"ranks leaves ranks without rows; name table_wise",
    ):
        explicit_plan(arch, dict.fromkeys(names, "table_wise") | {small.name: "row_wise"}, 4, 4, "cpu")
    plan = explicit_plan(
        arch, dict.fromkeys(names, "table_wise") | {"t_ad_id": "row_wise", "t_user_id": "table_wise:1"}, 2, 2, "cpu"
    )
    lines = {line.split()[0]: line.split() for line in format_plan(plan, arch, 2).splitlines()[2:]}
    assert lines["t_ad_id"][1:] == ["80", "8", "row_wise", "0,1", "1.2", "KiB", "1.2", "KiB"]  # 40 rows x 8 x 4 B each
    assert lines["t_user_id"][3:] == ["table_wise", "1", "0", "B", "1.6", "KiB"]  # 50 x 8 x 4 B on rank 1
