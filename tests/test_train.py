import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gem.data.format.dataset import split_files
from gem.data.pipeline.loader import build_loader
from gem.train.checkpoint import list_checkpoints
from gem.train.config import ConfigError, validate
from gem.train.losses import multitask_bce
from gem.train.optim import build_optimizers
from gem.train.setup import build_model, init_distributed, load_data
from gem.train.trainer import train
from tests.conftest import compose, needs_fbgemm_cuda


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cfg(cache_dir, run_dir, *overrides):
    return compose(["debug=tiny", f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *overrides])


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], rows


@pytest.mark.parametrize("sparse", ["sparse=torchrec", "sparse=native", "sparse.shard=false"])
def test_twenty_steps_loss_falls_and_outputs_are_written(cache_dir, tmp_path, sparse):
    result = train(_cfg(cache_dir, tmp_path, sparse, "trainer.log_every=1"))
    losses, rows = _losses(tmp_path)
    assert len(losses) == 20 and result["steps"] == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.02, losses
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert all(r["examples_per_s"] > 0 and 0 <= r["data_wait_frac"] <= 1 and r["step_ms"] > 0 for r in train_rows)
    assert rows[-1]["kind"] == "test" and rows[-1]["click/count"] == 600
    saved = json.loads((tmp_path / "test_metrics.json").read_text())
    assert saved["click/auc"] == pytest.approx(result["click/auc"]) and 0 < saved["click/auc"] <= 1
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "train.log").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_fbgemm_cuda])])
def test_sharded_torchrec_and_native_train_identically(cache_dir, tmp_path, device):
    """Fused row-wise Adagrad inside TorchRec's sharded tables == TorchRec's RowWiseAdagrad on plain
    tables, step for step, from the same weights, through a learning-rate warm-up that both the
    dense and the table optimizers follow (the fused one through its zero_grad / step). On a GPU
    the sharded side runs FBGEMM's CUDA kernels (table-batched lookups, the optimizer in backward)."""
    from gem.train.step import OptimizerSet

    models = []
    for backend in ("torchrec", "native"):
        config = validate(
            _cfg(cache_dir, tmp_path, f"sparse={backend}", "optim.warmup_steps=4", f"trainer.device={device}")
        )
        env = init_distributed(device, need_process_group=backend == "torchrec")
        torch.manual_seed(0)
        schema, data_dir = load_data(config, env)
        model = build_model(config, schema, env)
        dense_opt, sparse_opt, schedule = build_optimizers(model, config.optim, total_steps=10)
        fused = getattr(model.sparse_arch, "fused_optimizer", None)
        assert (fused is not None) == (backend == "torchrec")
        models.append((model, OptimizerSet((dense_opt, sparse_opt, fused), [], 0.0), schedule))
    (sharded, *_), (native, *_) = models
    native.dense_arch.load_state_dict(sharded.dense_arch.state_dict())
    tables = {
        k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
        for k, v in sharded.sparse_arch.state_dict().items()
    }
    native.sparse_arch.load_state_dict(tables)
    reader = build_loader(split_files(data_dir, "train"), schema, 64, options={"balance": False})
    weights = torch.ones(schema.num_tasks)
    # float32 both sides; on the GPU the two backward passes sum rows in another order
    tolerance = dict(rel=1e-5, abs=1e-6) if device == "cpu" else dict(rel=1e-4, abs=1e-5)
    for step, batch in zip(range(8), reader):
        batch, losses = batch.to(env.device), []
        for model, optimizers, schedule in models:
            optimizers.zero_grad()
            loss, _ = multitask_bce(model(batch), batch.labels, batch.label_mask, weights.to(env.device))
            loss.backward()
            optimizers.step()
            schedule.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], **tolerance), f"step {step}: {losses}"
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_schedule_scales_every_optimizer_and_resumes_from_its_step(cache_dir, tmp_path):
    config = validate(_cfg(cache_dir, tmp_path, "sparse=native", "optim.warmup_steps=4", "optim.schedule=cosine"))
    env = init_distributed("cpu", need_process_group=False)
    schema, _ = load_data(config, env)
    model = build_model(config, schema, env)
    dense_opt, sparse_opt, schedule = build_optimizers(model, config.optim, total_steps=10)
    lrs = lambda: (dense_opt.param_groups[0]["lr"], sparse_opt.param_groups[0]["lr"])  # noqa: E731
    base = (config.optim.dense.lr, config.optim.sparse.lr)
    assert lrs() == pytest.approx((base[0] / 4, base[1] / 4))
    for _ in range(6):
        schedule.step()
    expected = pytest.approx([b * 0.5 * (1 + math.cos(math.pi * 2 / 6)) for b in base])
    assert list(lrs()) == expected
    dense_opt, sparse_opt, fresh = build_optimizers(model, config.optim, total_steps=10)
    fresh.load_state_dict(schedule.state_dict())
    assert list(lrs()) == expected and fresh.get_last_lr() == [lrs()[0]]


def test_unknown_task_weight_and_empty_dataset_fail_clearly(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="trainer.task_weights.ctr: unknown task"):
        train(_cfg(cache_dir, tmp_path, "+trainer.task_weights.ctr=2.0"))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="holds no \\*.parquet files"):
        train(_cfg(cache_dir, tmp_path / "run", "data=parquet", f"data.dir={tmp_path / 'empty'}", "data.schema={}"))


def test_best_metric_tests_the_weights_of_the_best_validation(cache_dir, tmp_path):
    """trainer.best_metric: the test metrics are those of the best validation's weights (here the
    lowest click AUC, so not the last step's), the same as a run stopped at that step; a resumed run
    keeps the best found before its restart; a run that never validates before its end is refused."""
    select = ("trainer.eval_every=2", "trainer.best_metric=click/auc", "trainer.best_mode=min")
    result = train(_cfg(cache_dir, tmp_path / "best", *select))
    val = {r["step"]: r["click/auc"] for r in _losses(tmp_path / "best")[1] if r["kind"] == "val"}
    step = min(val, key=val.get)
    assert len(val) == 10 and result["best_step"] == step < 20 and result["best_val/click/auc"] == val[step]
    stopped = train(_cfg(cache_dir, tmp_path / "stopped", f"trainer.max_steps={step}"))
    assert (result["click/auc"], result["click/ne"]) == (stopped["click/auc"], stopped["click/ne"])

    run, checkpoints = tmp_path / "resumed", ("checkpoint.enabled=true", "checkpoint.every_steps=2")
    train(_cfg(cache_dir, run, *select, *checkpoints, "trainer.max_steps=6"))
    before = json.loads((run / "best" / "best.json").read_text())
    resumed = train(_cfg(cache_dir, run, *select, *checkpoints, "trainer.max_steps=12"))
    val = {r["step"]: r["click/auc"] for r in _losses(run)[1] if r["kind"] == "val"}
    assert sorted(val) == [2, 4, 6, 8, 10, 12] and before["step"] <= 6
    assert resumed["best_step"] == before["step"] == min(val, key=val.get)  # a step of the first run, kept
    assert json.loads((run / "best" / "best.json").read_text()) == before
    assert not (run / ".tmp-best").exists()

    fresh = ("trainer.max_steps=3", "trainer.eval_every=3", "checkpoint.enabled=false")  # its one validation: step 3's
    train(_cfg(cache_dir, run, *select[1:], *fresh))
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 3  # the old best (lower AUC) was dropped
    with pytest.raises(ConfigError, match="trainer.best_metric='click/auc' .* set trainer.eval_every"):
        validate(_cfg(cache_dir, tmp_path, "trainer.best_metric=click/auc"))
    with pytest.raises(ConfigError, match="trainer.best_metric='click/hr@10': validation does not log it"):
        train(_cfg(cache_dir, tmp_path / "unknown", "trainer.eval_every=10", "trainer.best_metric=click/hr@10"))


def test_eval_every_minus_one_validates_after_every_epoch(cache_dir, tmp_path):
    """trainer.eval_every=-1: a validation at the end of each epoch (31 steps of 64 of the 2,000
    training rows); below -1 it is refused."""
    result = train(_cfg(cache_dir, tmp_path, "trainer.max_steps=-1", "trainer.epochs=2", "trainer.eval_every=-1"))
    val = [r["step"] for r in _losses(tmp_path)[1] if r["kind"] == "val"]
    assert val == [31, 62] and result["steps"] == 62
    with pytest.raises(ConfigError, match=r"trainer.eval_every=-2 must be >= 0 \(steps\), or -1"):
        validate(_cfg(cache_dir, tmp_path, "trainer.eval_every=-2"))


def test_min_steps_raises_a_small_splits_epochs(cache_dir, tmp_path):
    """trainer.min_steps: 31 steps an epoch (2,000 training rows in batches of 64) fall short of 40,
    so the run trains two whole epochs; a floor the epochs already reach changes nothing."""
    raised = train(_cfg(cache_dir, tmp_path / "raised", "trainer.max_steps=-1", "trainer.min_steps=40"))
    assert raised["steps"] == 62
    kept = train(_cfg(cache_dir, tmp_path / "kept", "trainer.max_steps=-1", "trainer.min_steps=31"))
    assert kept["steps"] == 31
    with pytest.raises(ConfigError, match="trainer.min_steps"):
        validate(_cfg(cache_dir, tmp_path, "trainer.min_steps=-1"))


def test_best_patience_stops_a_run_and_its_restart(cache_dir, tmp_path):
    """trainer.best_patience=2: the validations of steps 4 and 6 bring no lower click AUC than step
    2's, so the run stops at step 6, checkpointed there (not a multiple of every_steps), and tests
    step 2's weights; a restart then trains no step; without best_metric it is refused."""
    run, steps = tmp_path / "patient", []
    stop = (
        "trainer.eval_every=2",
        "trainer.best_metric=click/auc",
        "trainer.best_mode=min",
        "trainer.best_patience=2",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=5",
    )
    stopped = train(_cfg(cache_dir, run, *stop))
    assert (stopped["steps"], stopped["best_step"]) == (6, 2)
    assert stopped["click/auc"] == train(_cfg(cache_dir, tmp_path / "two", "trainer.max_steps=2"))["click/auc"]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000000005", "step_000000006"]
    restarted = train(_cfg(cache_dir, run, *stop), hooks=[lambda step, rank, batch: steps.append(step)])
    assert steps == [] and restarted["steps"] == 6 and restarted["click/auc"] == stopped["click/auc"]
    with pytest.raises(ConfigError, match="trainer.best_patience=2 counts validations .* set trainer.best_metric"):
        validate(_cfg(cache_dir, tmp_path, "trainer.best_patience=2"))
    # a pretraining stage neither validates nor selects: the run's own settings are not the stage's
    staged = train(_cfg(cache_dir, tmp_path / "staged", *stop[:4], "trainer.pretrain=['trainer.max_steps=2']"))
    assert "best_step" in staged and not (tmp_path / "staged" / "pretrain" / "best").exists()


def test_row_buckets_train_the_same_losses_and_bad_values_fail(cache_dir, tmp_path):
    """parallelism.row_bucket (empty examples padding the dense arch's inputs to few shapes, for
    CUDA graphs) leaves every step's loss as it was."""
    common = ["model=gem_tiny", "sparse=native", "trainer.log_every=1", "trainer.plots=false", "trainer.max_steps=6"]
    train(_cfg(cache_dir, tmp_path / "plain", *common))
    train(_cfg(cache_dir, tmp_path / "bucket", *common, "parallelism.row_bucket=100"))
    plain, bucket = (_losses(tmp_path / name)[0] for name in ("plain", "bucket"))
    assert len(plain) == 6 and bucket == pytest.approx(plain, rel=1e-5, abs=1e-6)
    config = validate(_cfg(cache_dir, tmp_path / "bucket", *common, "parallelism.row_bucket=100"))
    env = init_distributed("cpu", need_process_group=False)
    schema, _ = load_data(config, env)
    model = build_model(config, schema, env)  # what train() ran: the model pads
    assert model.row_bucket == 100 and model.max_lens == {g.name: g.max_len for g in schema.sequence_groups}
    with pytest.raises(ConfigError, match="parallelism.row_bucket=-1 must be >= 0"):
        train(_cfg(cache_dir, tmp_path / "bad", *common, "parallelism.row_bucket=-1"))
    graphs = ["parallelism.compile=true", "+parallelism.inductor.triton.cudagraphs=true"]
    config = validate(_cfg(cache_dir, tmp_path / "fsdp", *common, *graphs, "parallelism.fully_shard=true"))
    with pytest.raises(
        ConfigError, match="cudagraphs=true under FSDP2.*set parallelism.inductor.triton.cudagraphs=false"
    ):
        build_model(config, schema, env)  # refused before any process group is needed


def test_quickstart_default_learns_the_hidden_signal(tmp_path):
    """The embedded default (`make train`), end to end: the click AUC on the test split."""
    result = train(compose([f"trainer.run_dir={tmp_path}", "trainer.progress_bar=false"]))
    assert result["click/auc"] > 0.75, result
    assert result["conversion/auc"] > 0.7, result


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", ["sparse=native", pytest.param("sparse=torchrec", marks=needs_fbgemm_cuda)])
def test_trainer_on_cuda(cache_dir, tmp_path, sparse):
    """On a GPU; with sparse=torchrec the tables are sharded onto FBGEMM's fused CUDA kernels and
    TorchRec's TrainPipelineSparseDist drives the steps (its default on CUDA)."""
    result = train(_cfg(cache_dir, tmp_path, sparse, "trainer.device=cuda"))
    assert result["steps"] == 20 and result["click/auc"] > 0.5
    pipelined = sparse == "sparse=torchrec"
    log = (tmp_path / "train.log").read_text()
    assert f"overlaps dense compute of batch i): {'active' if pipelined else 'off'}" in log, log[-3000:]
    if dist.is_initialized():
        dist.destroy_process_group()


def test_compile_trains_like_eager(cache_dir, tmp_path, monkeypatch):
    """parallelism.compile=true gives the eager run's losses, both per GEM block (compile_scope=blocks,
    Inductor, here on CPU) and with the whole dense arch as one graph (dense_arch). The whole arch
    is captured by Dynamo and AOTAutograd here but not lowered by Inductor, whose C++ build of one
    graph that size takes minutes on a cold CPU cache (it ran on the H200: docs/e2e.md).

    To keep CI's cold compile short, Inductor writes scalar C++ loops here (no SIMD intrinsics to
    build) and the model has one interaction (dot); docs/training.md has the timings."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa())
    # simdlen=1 matches no ISA, so Inductor writes scalar loops. Not cpp.vec_isa_ok=False: Inductor
    # caches its ISA checks once per process, and the worker's later compiles (their cache hits too)
    # would lose the SIMD headers. And config.patch, not monkeypatch, whose undo deletes the key.
    compile_module = nn.Module.compile
    runs = {}
    with inductor_config.patch({"cpp.simdlen": 1}):
        for compiled, scope in (("false", "blocks"), ("true", "blocks"), ("true", "dense_arch")):
            run_dir = tmp_path / f"{compiled}-{scope}"
            if scope == "dense_arch":
                monkeypatch.setattr(nn.Module, "compile", lambda m, **kw: compile_module(m, backend="aot_eager", **kw))
            train(
                _cfg(
                    cache_dir,
                    run_dir,
                    "model=gem_tiny",
                    "model.interaction=[dot]",
                    "trainer.max_steps=3",
                    "trainer.log_every=1",
                    f"parallelism.compile={compiled}",
                    f"parallelism.compile_scope={scope}",
                )
            )
            runs[compiled, scope] = _losses(run_dir)[0]
            entry = json.loads((run_dir / "startup.json").read_text()).get("first step compile")
            assert (entry is not None and entry["frames"] >= 1 and entry["backend"] > 0) == (compiled == "true"), entry
            if compiled == "true":  # gem_tiny's blocks are several frames; the whole arch is one, no graph break
                assert (entry["frames"] == 1) == (scope == "dense_arch"), (scope, entry)
    assert str(pick_vec_isa()) == isa  # the process's later compiles keep their SIMD
    assert len(runs["true", "dense_arch"]) == 3
    for scope in ("blocks", "dense_arch"):
        assert runs["true", scope] == pytest.approx(runs["false", "blocks"], rel=1e-4), runs
    whole = ("parallelism.compile=true", "parallelism.compile_scope=dense_arch")
    with pytest.raises(ConfigError, match="activation checkpointing wraps each block: set parallelism.compile_scope"):
        train(_cfg(cache_dir, tmp_path / "ac", *whole, "parallelism.activation_checkpointing=true"))
    with pytest.raises(ConfigError, match="parallelism.compile_scope='layers' is not one of"):
        train(_cfg(cache_dir, tmp_path / "bad", "parallelism.compile_scope=layers"))


@pytest.mark.parametrize("model", ["model=dlrm", "model=gem_tiny"])
def test_bf16_autocast_tracks_float32(cache_dir, tmp_path, model):
    """trainer.autocast=bfloat16 runs the dense forward in bf16 (on CPU too) and trains like float32:
    per-step losses within bf16 rounding of the float32 run (tolerance 1e-2 relative: bf16 keeps 8
    mantissa bits, and 20 steps of AdamW let the two runs drift apart slowly)."""
    runs = {}
    for dtype in ("null", "bfloat16"):
        run_dir = tmp_path / dtype
        train(_cfg(cache_dir, run_dir, model, "trainer.log_every=1", f"trainer.autocast={dtype}"))
        runs[dtype] = _losses(run_dir)[0]
    assert runs["bfloat16"] != runs["null"]  # autocast really changed the arithmetic
    assert runs["bfloat16"] == pytest.approx(runs["null"], rel=1e-2), runs
    with pytest.raises(ConfigError, match="trainer.autocast='float16' is not one of"):
        train(_cfg(cache_dir, tmp_path / "f16", "trainer.autocast=float16"))


def test_profile_writes_a_trace_and_a_breakdown(cache_dir, tmp_path):
    """trainer.profile records the chosen steps: a gzipped Chrome trace and the time by kind."""
    import gzip

    train(
        _cfg(
            cache_dir,
            tmp_path,
            "model=gem_tiny",
            "sparse=native",
            "trainer.max_steps=6",
            "trainer.profile.start=3",
            "trainer.profile.steps=2",
        )
    )
    trace = json.loads(gzip.open(tmp_path / "profile" / "trace_rank0.json.gz").read())
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"]) == 2
    result = json.loads((tmp_path / "profile" / "breakdown_rank0.json").read_text())
    assert result["device"] == "cpu" and result["steps"] == 2 and result["recorded_steps"] == [3, 4]
    assert result["ms_per_step_by_kind"]["gemm"] > 0 and result["ms_per_step"] > 0
    assert sum(result["frac_of_busy_by_kind"].values()) == pytest.approx(1, abs=1e-3)
    assert result["top"][0]["ms_per_step"] >= result["top"][-1]["ms_per_step"]


def test_profile_drains_the_gpu_queue_and_stops_after_the_recorded_steps(monkeypatch, tmp_path):
    """On a GPU the host runs ahead: kernels still queued from the step before the recording would
    be booked to the recorded steps, so the profiler synchronizes before the first recorded step and
    after the last one (steps 4-5 here: after loop iterations 2 and 4). Then it stops, so that the
    steps after the recording do not pay for it."""
    from gem.train.config import ProfileConfig
    from gem.train.profile import StepProfiler

    synced, finished, running = [], [], []  # the loop iterations that synchronized; done; with the profiler
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(len(finished)))
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    profiler = StepProfiler(ProfileConfig(start=4, steps=2), tmp_path, 0, first_step=0, on_cuda=True)
    for _ in range(7):
        torch.ones(8).sum()
        profiler.step()
        finished.append(True)
        running.append(profiler._prof is not None)
    profiler.close()
    assert synced == [2, 4]
    # stopped once the recorded steps are written, with TEARDOWN_CUPTI=1 so that Kineto detaches CUPTI
    assert running == [True] * 4 + [False] * 3 and os.environ["TEARDOWN_CUPTI"] == "1"
    assert json.loads((tmp_path / "breakdown_rank0.json").read_text())["recorded_steps"] == [4, 5]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_192x128_64x4_2x1_v_bz_coopA_TNN", "gemm"),
        ("triton_tem_fused_addmm_3", "gemm"),
        ("_fwd_kernel", "attention"),
        ("_bwd_dkdv_kernel", "attention"),
        ("_gdpa_fwd_kernel", "attention"),
        ("_pool_bwd_kernel", "attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("triton_poi_fused__to_copy_add_cat_mul_7", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "elementwise"),
        ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int>", "embedding"),
        ("triton_red_fused_embedding_dense_backward_2", "embedding"),
        ("fbgemm::jagged_to_padded_dense_forward", "embedding"),
        ("void fbgemm_gpu::batch_index_select_dim0_codegen_forward_kernel<float, float>", "embedding"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>",
            "elementwise",
        ),
    ],
)
def test_profile_kinds(name, kind):
    from gem.train.profile import kind_of

    assert kind_of(name) == kind


def test_table_replicas_are_synced_after_every_step():
    """A sparse arch with sync() (TorchRec's DMPCollection under sparse.sharding_group_size, CUDA
    only) has its per-group table copies averaged after each optimizer step."""
    from torch import nn

    from gem.train.step import OptimizerSet, TrainStep

    class Replicated(nn.Module):
        calls: list[float] = []

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def sync(self):
            self.calls.append(float(self.weight))  # the weight after the step it follows

    class Batch:
        batch_size, x = 1, torch.ones(1)

        def to(self, *args, **kwargs):
            return self

    model = nn.Module()
    model.sparse_arch = Replicated()
    model.forward = lambda batch: model.sparse_arch.weight * batch.x
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = TrainStep(
        model,
        lambda out, batch: (out.sum(), out.detach()),
        OptimizerSet((optimizer,), [], 0.0),
        torch.device("cpu"),
        pipelined=False,
    )
    batches = iter([Batch(), Batch()])
    step(batches)
    step(batches)
    assert Replicated.calls == [0.5, 0.0]


def test_a_kernel_that_fails_to_build_falls_back_and_the_run_records_it(cache_dir, tmp_path, monkeypatch):
    """kernels=triton whose attention kernels fail to build (injected: the check runs as on a GPU
    and fails) trains on the reference with the reference run's losses, warns, and records the
    fallback in startup.json and as a ``fallback`` row of metrics.jsonl."""
    from kernels import fallback
    from kernels.jagged_attention import triton_common

    reference = tmp_path / "reference"
    train(
        _cfg(cache_dir, reference, "model=gem_tiny", "kernels=reference", "trainer.max_steps=4", "trainer.log_every=1")
    )

    def fails(*variant):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_common, "INTERPRET", False)
    monkeypatch.setitem(fallback.PROBES, "jagged_attention", fails)
    monkeypatch.setitem(fallback.PROBES, "rotary_self_attention", fails)
    monkeypatch.setitem(fallback.PROBES, "rotary_qkv", fails)
    monkeypatch.setitem(fallback.PROBES, "attention_pooling", fails)
    fallback.clear()
    run = tmp_path / "triton"
    with pytest.warns(RuntimeWarning, match="falls back to reference: RuntimeError: PassManager::run failed"):
        train(_cfg(cache_dir, run, "model=gem_tiny", "kernels=triton", "trainer.max_steps=4", "trainer.log_every=1"))
    fallback.clear()
    assert _losses(run)[0] == _losses(reference)[0]
    startup = json.loads((run / "startup.json").read_text())["kernel_fallbacks"]
    rows = [r for r in _losses(run)[1] if r["kind"] == "fallback"]
    assert startup and [r["kernel"] for r in rows] == [e["kernel"] for e in startup]
    assert all(r["to"] == "reference" and r["setting"] == "kernels.attention_backend=reference" for r in rows)


def test_a_missing_val_split_warns_once_and_an_empty_train_split_names_itself(tiny_dataset, cache_dir, tmp_path):
    """data=parquet without val/: the run trains and says once that it validates nothing; a train
    split whose files hold no rows fails naming the split (a smaller batch cannot help)."""
    import shutil

    import pyarrow.parquet as pq

    from gem.data.errors import DataError

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    shutil.rmtree(data / "val")
    parquet = ["data=parquet", f"data.dir={data}", "data.schema={}", "trainer.max_steps=2"]
    train(_cfg(cache_dir, tmp_path / "run", *parquet, "trainer.eval_every=0"))
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("this run validates nothing") == 1 and f"{data / 'val'} is missing" in log
    for path in (data / "train").glob("*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.slice(0, 0).replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(DataError, match=f"the training split {data / 'train'} holds no rows"):
        train(_cfg(cache_dir, tmp_path / "empty", *parquet))


def _touched_rows_step(weight, grad, state_sum, lr, eps, decay):
    """The hand computation of one row-wise Adagrad step with an L2 decay on the touched rows, row by
    row in float64: ``(weight, state_sum)`` after the step."""
    weight, state_sum = weight.double().clone(), state_sum.double().clone()
    for i in range(weight.shape[0]):
        if not grad[i].any():
            continue
        g = grad[i].double() + decay * weight[i]
        state_sum[i] += (g**2).mean()
        weight[i] -= lr * g / (state_sum[i].sqrt() + eps)
    return weight, state_sum


def test_touched_rows_adagrad_decays_the_touched_rows_only():
    """optim.sparse.weight_decay on plain tables: each row with a nonzero gradient gets ``g += wd * w``
    before the row-wise Adagrad step (against a hand computation, over three steps so that the state
    carries); rows without a gradient keep their weights and state bit for bit."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from gem.train.optim import TouchedRowsAdagrad

    gen = torch.Generator().manual_seed(0)
    table = nn.Parameter(torch.randn(7, 5, generator=gen))
    lr, eps, decay = 0.1, 1e-3, 0.3
    opt = TouchedRowsAdagrad([table], lr=lr, eps=eps, weight_decay=decay)
    weight, state_sum = table.detach().clone(), torch.zeros(7, 1)
    for touched in ([1, 3, 4], [3, 6], [0, 1]):
        grad = torch.zeros(7, 5)
        grad[touched] = torch.randn(len(touched), 5, generator=gen)
        table.grad = grad
        before, sum_before = table.detach().clone(), opt.state[table]["sum"].clone()
        opt.step()
        weight, state_sum = _touched_rows_step(weight, grad, state_sum, lr, eps, decay)
        torch.testing.assert_close(table.detach().double(), weight, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[table]["sum"].double(), state_sum, rtol=1e-6, atol=1e-9)
        untouched = [i for i in range(7) if i not in touched]
        assert torch.equal(table.detach()[untouched], before[untouched])
        assert torch.equal(opt.state[table]["sum"][untouched], sum_before[untouched])
    # TorchRec's own weight_decay (the base class's) moves the rows without a gradient too
    table.grad = torch.zeros(7, 5)
    table.grad[1] = 1.0
    before = table.detach().clone()
    RowWiseAdagrad([table], lr=lr, eps=eps, weight_decay=decay).step()
    assert not torch.equal(table.detach()[2], before[2])


def test_weight_decay_zero_leaves_both_table_optimizers_as_they_were(tiny_schema):
    """optim.sparse.weight_decay=0 (the default): the plain tables' steps are TorchRec's RowWiseAdagrad's
    bit for bit, and the fused tables get the same FBGEMM arguments as before (lr and eps only)."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from gem.distributed.sharding import fuse_optimizer
    from gem.sparse.arch import SparseArch
    from gem.train.optim import TouchedRowsAdagrad

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(9, 4, generator=gen)
    tables = [nn.Parameter(start.clone()) for _ in range(2)]
    opts = [TouchedRowsAdagrad([tables[0]], lr=0.05, eps=1e-8), RowWiseAdagrad([tables[1]], lr=0.05, eps=1e-8)]
    for _ in range(3):
        grad = torch.randn(9, 4, generator=gen) * (torch.rand(9, 1, generator=gen) < 0.5)
        for table, opt in zip(tables, opts):
            table.grad = grad.clone()
            opt.step()
    assert torch.equal(tables[0], tables[1])
    assert torch.equal(opts[0].state[tables[0]]["sum"], opts[1].state[tables[1]]["sum"])

    arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
    fuse_optimizer(arch, "rowwise_adagrad", 0.05, 1e-8, weight_decay=0.0)
    assert all(p._optimizer_kwargs == [{"lr": 0.05, "eps": 1e-8}] for p in arch.parameters())


def test_fused_parameters_carry_the_decay_in_fbgemm_l2_mode(tiny_schema):
    """The in-backward optimizer's arguments are what TorchRec hands FBGEMM's fused kernels: the decay
    with WeightDecayMode.L2 on every trained table, none on a frozen one (learning rate 0)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    from gem.distributed.sharding import fuse_optimizer
    from gem.sparse.arch import SparseArch

    arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
    fuse_optimizer(arch, "rowwise_adagrad", 0.05, 1e-8, frozen_tables=["t_ad_id"], weight_decay=1e-3)
    frozen = arch.table_weight("t_ad_id")
    for p in arch.parameters():
        expected = {"lr": 0.05, "eps": 1e-8, "weight_decay": 1e-3, "weight_decay_mode": WeightDecayMode.L2}
        assert p._optimizer_kwargs == ([{"lr": 0.0, "eps": 1e-8}] if p is frozen else [expected])
    with pytest.raises(ValueError, match="optim.sparse.weight_decay=0.001 needs optim.sparse.name=rowwise_adagrad"):
        fuse_optimizer(SparseArch.from_config(tiny_schema, 8, device="meta"), "adagrad", 0.05, 1e-8, weight_decay=1e-3)


@pytest.mark.parametrize(
    "device, pooled",
    [
        ("cpu", "data_parallel"),  # FBGEMM's CPU kernel for pooled tables drops the decay: refused there
        pytest.param("cuda", "table_wise", marks=[pytest.mark.gpu, needs_fbgemm_cuda]),
    ],
)
def test_one_sharded_step_decays_the_touched_rows(tiny_dataset, tiny_schema, device, pooled):
    """TorchRec-sharded tables with optim.sparse.weight_decay, one step against the formula from the
    plain tables' gradient: the sequence tables (row_wise) in FBGEMM's fused kernel, the pooled ones
    fused too on CUDA, data-parallel on CPU (stepped by TouchedRowsAdagrad); untouched rows unchanged.
    On CPU, pooled tables in FBGEMM's fused kernel are refused with the key and the fix."""
    from gem.distributed.sharding import shard_sparse_arch
    from gem.sparse.arch import SparseArch
    from gem.train.config import OptimConfig, SparseOptimConfig

    lr, eps, decay = 0.1, 1e-8, 0.5
    env = init_distributed(device, need_process_group=True)
    try:
        if device == "cpu":
            arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
            with pytest.raises(ValueError, match=r"optim.sparse.weight_decay=0.5: FBGEMM's CPU kernel for pooled.*"):
                shard_sparse_arch(arch, env.device, lr, eps, "table_wise", weight_decay=decay)
        torch.manual_seed(0)
        reference = SparseArch.from_config(tiny_schema, 8, backend="native")
        reference.init_weights()
        plan = {t.name: pooled if t.pooled else "row_wise" for t in reference.tables}
        arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
        sharded = shard_sparse_arch(arch, env.device, lr, eps, plan=plan, weight_decay=decay)
        local = lambda t: t.local_shards()[0].tensor if hasattr(t, "local_shards") else t  # noqa: E731
        start = reference.state_dict()
        with torch.no_grad():
            for name, table in sharded.state_dict().items():
                local(table).copy_(start[name])
        holder = nn.Module()  # build_optimizers' view of a model: the tables and a dense part
        holder.sparse_arch, holder.dense = sharded, nn.Linear(1, 1, device=env.device)
        _, plain, _ = build_optimizers(
            holder, OptimConfig(sparse=SparseOptimConfig(lr=lr, eps=eps, weight_decay=decay)), 1
        )
        batch = next(
            iter(build_loader(split_files(tiny_dataset, "train"), tiny_schema, 32, options={"balance": False}))
        )
        for model, b in ((reference, batch), (sharded, batch.to(env.device))):
            out = model(b.sparse, b.sequences, b.max_seq_len)
            gen = torch.Generator().manual_seed(1)
            values = [*out.pooled.values(), out.sequences["hist"].values]
            sum((v * torch.randn(v.shape, generator=gen).to(v.device)).sum() for v in values).backward()
        if plain is not None:
            plain.step()
        tolerance = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
        for name, table in sharded.state_dict().items():
            weight, grad = start[name], reference.table_weight(name.split(".")[-2]).grad
            expected, _ = _touched_rows_step(weight, grad, torch.zeros(len(weight), 1), lr, eps, decay)
            after, touched = local(table).cpu(), grad.ne(0).any(1)
            assert 0 < int(touched.sum()) < len(weight) or len(weight) < 8, name
            torch.testing.assert_close(after.double(), expected, **tolerance, msg=name)
            assert torch.equal(after[~touched], weight[~touched]), name
            without_decay, _ = _touched_rows_step(weight, grad, torch.zeros(len(weight), 1), lr, eps, 0.0)
            assert not torch.allclose(after.double()[touched], without_decay[touched], **tolerance), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_trainer_applies_the_table_weight_decay_or_refuses_it_by_name(cache_dir, tmp_path):
    """optim.sparse.weight_decay through train(): plain tables train with it; TorchRec-sharded pooled
    tables on CPU (FBGEMM's kernel would drop it) stop the run with the key and the fix."""
    result = train(_cfg(cache_dir, tmp_path / "native", "sparse=native", "optim.sparse.weight_decay=1e-3"))
    assert result["steps"] == 20 and math.isfinite(result["click/ne"])
    with pytest.raises(ConfigError, match=r"optim.sparse.weight_decay=0.001: FBGEMM's CPU kernel for pooled tables"):
        train(_cfg(cache_dir, tmp_path / "sharded", "sparse=torchrec", "optim.sparse.weight_decay=1e-3"))
    if dist.is_initialized():
        dist.destroy_process_group()
