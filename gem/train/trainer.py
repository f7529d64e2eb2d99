"""``train(cfg)``: build every component once, then run a short, readable loop."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from gem.data.errors import DataError
from gem.data.pipeline.batch import Batch
from gem.data.pipeline.loader import BatchLoader
from gem.data.pipeline.schema import FeatureSchema
from gem.data.sources import DataSource, build_source
from gem.data.sources.stream import StreamLoader
from gem.models.gem import GEMModel
from gem.sparse.arch import SparseArch
from gem.train.best import BestWeights
from gem.train.checkpoint import Checkpointer, CheckpointError, Progress
from gem.train.config import Config, ConfigError, check_schema_refs, plain_config, validate
from gem.train.delta import build_exporter
from gem.train.flops import default_peak_tflops, mfu, step_flops
from gem.train.logging import MetricsWriter, format_metrics, logger, open_metrics, plot_curves, setup_logging
from gem.train.losses import multitask_bce
from gem.train.metrics import RankingEvaluator, TaskEvaluator, id_mapping_counts
from gem.train.optim import build_optimizers
from gem.train.profile import StepProfiler
from gem.train.startup import (
    StartupTimer,
    compile_breakdown,
    compile_counters,
    configure_threads,
    count_finished_run,
    format_summary,
    imported_from_source,
    start_compile_workers,
)
from gem.train.step import OptimizerSet, TimedIterator, TrainStep, autocast
from kernels import fallback as kernel_fallback

StepHook = Callable[[int, int, Batch], None]  # (step, rank, the batch it trained on), after each training step


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str, need_process_group: bool) -> DistEnv:
    """Read torchrun's environment; start a process group when there are several ranks or when
    TorchRec sharding needs one (a single-rank group otherwise)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; set trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if (world_size > 1 or need_process_group) and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if world_size > 1:
            dist.init_process_group(backend, timeout=timedelta(minutes=10), **_restart_store(rank, world_size))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(rank, world_size, local_rank, dev)


def _restart_store(rank: int, world_size: int) -> dict:
    """After a ``torchrun --max-restarts`` restart, a store whose keys are this attempt's own.

    torchrun's agent keeps one TCPStore across restarts; with the plain ``env://`` set-up a
    restarted gloo group can read the dead attempt's addresses and fail to connect (seen with
    torch 2.13 when the first attempt had created more than one group). A prefix per attempt
    keeps the attempts apart."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(minutes=10),
    )
    return {"store": dist.PrefixStore(f"gem_attempt_{attempt}/", store), "rank": rank, "world_size": world_size}


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def load_data(config: Config, env: DistEnv) -> tuple[FeatureSchema, Path]:
    """The schema and the data set folder of ``data`` (gem.data.build_source; rank 0 prepares it)."""
    source = build_source(config.data, is_writer=env.is_main)
    return source.schema, source.dir


def parallel_dims(config: Config, env: DistEnv):
    """The checked data-parallel layout (gem.distributed.ParallelDims); a bad one is a ConfigError."""
    from gem.distributed.parallel_dims import ParallelDims, ParallelLayoutError

    p = config.parallelism
    try:
        return ParallelDims(p.dp_replicate, p.dp_shard, env.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
    except ParallelLayoutError as e:
        raise ConfigError(str(e)) from None


def build_model(
    config: Config,
    schema: FeatureSchema,
    env: DistEnv,
    timer: StartupTimer | None = None,
    source: DataSource | None = None,
) -> GEMModel:
    """SparseArch (TorchRec-sharded or not) + the configured dense arch, materialized on ``env.device``,
    then ``parallelize_gem`` (FSDP2 / HSDP on the ParallelDims mesh when ``world_size > 1``). A
    generative arch with ``model.cooccurrence`` gets its prior from ``source``'s training split."""
    from gem.distributed.parallel_dims import dtype_from_name
    from gem.distributed.parallelize import parallelize_gem
    from kernels.jagged_attention import settings as kernel_settings

    kernel_settings.configure(**config.kernels.kernel_settings())  # once, before any kernel runs
    timer = timer or StartupTimer()
    s, p = config.sparse, config.parallelism
    dims = parallel_dims(config, env)
    shard = s.backend == "torchrec" and s.shard
    sparse = SparseArch.from_config(
        schema,
        s.embedding_dim,
        s.init_scale,
        s.dims,
        s.backend,
        device="meta" if shard else env.device,
        ids=s.ids,
        ids_device=env.device,
    )
    if shard:
        from gem.distributed.sharding import shard_sparse_arch

        try:
            with timer.phase("sharding"):
                sparse = shard_sparse_arch(
                    sparse,
                    env.device,
                    config.optim.sparse.lr,
                    config.optim.sparse.eps,
                    s.sharding_type,
                    plan=s.plan,
                    hbm_gb=s.hbm_gb,
                    constraints=s.constraints,
                    optimizer=config.optim.sparse.name,
                    sharding_group_size=s.sharding_group_size,
                    plan_file=s.plan_file,
                    frozen_tables=_frozen_tables(config, sparse),
                )
        except ValueError as e:  # plan errors name the sparse.* key; every rank raises the same one
            raise ConfigError(str(e)) from None
    else:
        sparse.init_weights()
        if env.world_size > 1:  # the only buffers are sparse.ids' maps, kept equal by their own all-gather
            sparse = nn.parallel.DistributedDataParallel(sparse, broadcast_buffers=False)
    arch = sparse.module if hasattr(sparse, "module") else sparse
    feature_dims = {f: arch.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims.update({g.name: arch.sequence_dim(g.name) for g in schema.sequence_groups})
    try:
        with torch.device("meta"):
            build = instantiate(config.model, _partial_=True, _convert_="all")
            if config.trainer.distill.representation > 0 or config.trainer.distill.adapter:
                from gem.transfer.student import wrap_dense  # the student also reads the teacher's outputs

                dense = wrap_dense(config, schema, feature_dims, build)
            else:
                dense = build(schema=schema, feature_dims=feature_dims)
    except (DataError, CheckpointError):
        raise
    except Exception as e:  # Hydra wraps constructor errors; name the config node.
        raise ConfigError(f"model: could not build {config.model.get('_target_')}: {e}") from e
    dense.to_empty(device=env.device)
    dense.init_weights()  # the same on every rank (same seed): fully_shard keeps each rank's slice
    if getattr(dense, "cooccurrence", 0):  # a seqrec ranking prior, from the training split (docs/seqrec.md)
        if source is None:
            raise ConfigError("model.cooccurrence needs the training split: build the model with its data source")
        from gem.data.sources.seqrec import item_cooccurrence

        keys, values = item_cooccurrence(source.files("train"), dense.num_items, dense.item_feature)
        dense.set_cooccurrence(torch.from_numpy(keys), torch.from_numpy(values))
    if p.row_bucket and (getattr(dense, "teacher_inputs", False) or getattr(dense, "sequence_ids", ())):
        raise ConfigError(
            "parallelism.row_bucket pads the ranking model's inputs; this model reads sequence ids or a "
            "teacher's outputs, which it does not pad: set parallelism.row_bucket=0"
        )
    max_lens = {g.name: g.max_len for g in schema.sequence_groups}
    model = GEMModel(sparse, dense, p.row_bucket, max_lens)
    use_fsdp = p.fully_shard if p.fully_shard is not None else env.world_size > 1
    if env.world_size > 1 and not use_fsdp:
        raise ConfigError(
            f"parallelism.fully_shard=false with {env.world_size} ranks would leave the dense gradients "
            f"unsynchronized; for whole copies on every rank use parallelism=replicate"
        )
    if p.compile and p.compile_scope == "dense_arch" and (use_fsdp or p.activation_checkpointing):
        raise ConfigError(
            "parallelism.compile_scope=dense_arch compiles the dense arch as one graph, but "
            f"{'FSDP2' if use_fsdp else 'activation checkpointing'} wraps each block: "
            "set parallelism.compile_scope=blocks"
        )
    if use_fsdp and p.inductor.get("triton.cudagraphs"):
        raise ConfigError(
            "parallelism.inductor.triton.cudagraphs=true under FSDP2: CUDA graphs over fully_shard's "
            "blocks have not been run with gem; set parallelism.inductor.triton.cudagraphs=false "
            "and parallelism.row_bucket=0 (experiment=gem_base_h200 turns them on for one GPU)"
        )
    mesh = dims.build_mesh(env.device.type) if use_fsdp else None
    logger.info(
        "dense: %s%s%s",
        dims.describe() if use_fsdp else "not sharded",
        f", compute {p.param_dtype}, reduce {p.reduce_dtype}" if use_fsdp else "",
        f", float8 projections of width >= {p.float8_min_features}" if p.float8 else "",
    )
    return parallelize_gem(
        model,
        mesh,
        param_dtype=dtype_from_name("parallelism.param_dtype", p.param_dtype),
        reduce_dtype=dtype_from_name("parallelism.reduce_dtype", p.reduce_dtype),
        activation_checkpointing=p.activation_checkpointing,
        compile=p.compile,
        compile_scope=p.compile_scope,
        compile_options=p.inductor or None,
        reshard_after_forward=p.reshard_after_forward,
        float8_min_features=p.float8_min_features if p.float8 else None,
        scatter_in_place=p.scatter_in_place,
        residual_addmm=p.residual_addmm,
    )


def _frozen_tables(config: Config, sparse: SparseArch) -> list[str]:
    if not config.checkpoint.init_frozen:
        return []
    from gem.transfer.params import frozen_tables

    return frozen_tables(sparse, config.checkpoint.init_frozen)


def apply_transfer(config: Config, model: nn.Module, ckpt_dir: Path) -> None:
    """Parameter sharing (``checkpoint.init_from`` / ``init_modules``) and freezing (``init_frozen``),
    before the optimizers are built. Resuming the run's own checkpoint takes precedence: then the
    shared tensors come from that checkpoint and ``init_from`` is not read."""
    c = config.checkpoint
    if not (c.init_from or c.init_frozen):
        return
    from gem.train.checkpoint import list_checkpoints
    from gem.transfer.params import freeze, init_from_checkpoint

    resuming = c.enabled and (c.load_from or (c.resume and list_checkpoints(ckpt_dir)))
    if c.init_from and resuming:
        logger.info("checkpoint.init_from: not read, the run resumes from its own checkpoint")
    elif c.init_from:
        init_from_checkpoint(model, c.init_from, c.init_modules)
    freeze(model, c.init_frozen)


def distill_loss(config: Config, schema: FeatureSchema, env: DistEnv, task_weights: torch.Tensor, group):
    """The loss function with ``trainer.distill`` (None when it is off): true labels mixed with a
    teacher's logits, ``batch.teacher``: the data's ``teacher_<task>`` columns, or filled by the
    online teacher (``gem.transfer.student.prepare_teacher`` checks or attaches either)."""
    dd = config.trainer.distill
    if dd.weight <= 0:
        return None
    tasks = list(dd.tasks) or list(schema.tasks)
    unknown = [k for k in tasks if k not in schema.tasks]
    if unknown:
        raise ConfigError(f"trainer.distill.tasks: {unknown} are not tasks of the data ({list(schema.tasks)})")
    weights = torch.tensor([dd.weight if k in tasks else 0.0 for k in schema.tasks], device=env.device)

    logger.info(
        "trainer.distill: weight %g, temperature %g, tasks %s, teacher outputs from %s",
        dd.weight,
        dd.temperature,
        tasks,
        dd.source,
    )
    return lambda logits, b: multitask_bce(
        logits,
        b.labels,
        b.label_mask,
        task_weights,
        b.weights,
        group=group,  # noqa: E731
        teacher=b.teacher,
        distill_weight=weights,
        temperature=dd.temperature,
    )


def split_loader(
    config: Config, env: DistEnv, source: DataSource, split: str, batch_size: int | None = None
) -> BatchLoader:
    """This rank's loader over ``split``: ``train`` shuffled, balanced, whole batches; others in order."""
    d, train = config.data, split == "train"
    batch_size = batch_size or (d.batch_size if train else d.eval_batch_size)
    return source.loader(
        split,
        batch_size,
        shuffle=train and d.shuffle,
        seed=d.seed,
        drop_last=train,
        rank=env.rank,
        world_size=env.world_size,
        num_workers=d.num_workers,
        pin_memory=env.device.type == "cuda",
        options=d.loader if train else {**d.loader, "balance": False},
    )  # eval: groups stay contiguous


def _split_rows(make_loader, split: str) -> tuple[int, str]:
    """The split's row count, and what to say of it when there are none (empty or missing)."""
    try:
        return make_loader(split).num_rows(), "has no examples"
    except FileNotFoundError as e:
        return 0, f"is missing ({e})"


def check_eval_splits(config: Config, make_loader, data_dir: Path) -> None:
    """Before training: a missing or empty validation split turns ``trainer.eval_every`` off with a
    warning (its AUC / NE would be NaN), or fails with ``trainer.best_metric``; a missing or empty
    test split fails now rather than after training, unless ``trainer.test`` is off."""
    if config.trainer.eval_every:
        rows, why = _split_rows(make_loader, "val")
        if rows == 0 and config.trainer.best_metric:
            raise DataError(
                f"trainer.best_metric={config.trainer.best_metric!r} picks weights by validation, and the "
                f"validation split {data_dir / 'val'} {why}: add examples there or unset trainer.best_metric"
            )
        if rows == 0:
            logger.warning(
                "trainer.eval_every=%d but the validation split %s %s: training without validation; add "
                "examples there or set trainer.eval_every=0",
                config.trainer.eval_every,
                data_dir / "val",
                why,
            )
            config.trainer.eval_every = 0  # this run's typed copy of the config
    if not config.trainer.test:
        return
    rows, why = _split_rows(make_loader, "test")
    if rows == 0:
        raise DataError(
            f"the test split {data_dir / 'test'} {why}; the run would end on NaN metrics: add examples there "
            "or set trainer.test=false"
        )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    max_batches: int = -1,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Per-task AUC / NE over a split, plus ranking metrics (HR, NDCG, MRR) when it has candidate
    groups (request ids). Every rank runs the same number of forward passes (sharded tables need
    all ranks in each step); a rank out of batches repeats its last one unrecorded. Torch's random
    state is restored after it, so evaluating mid-run leaves the training run as it would have been."""
    cuda = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        return _evaluate(model, loader, env, tasks, max_batches, autocast_dtype)


def _evaluate(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    max_batches: int,
    autocast_dtype: torch.dtype | None,
) -> dict[str, float]:
    model.eval()
    evaluator, ranking = TaskEvaluator(tasks), RankingEvaluator(tasks)
    steps = max(loader.reader.num_batches(r) for r in range(env.world_size))
    if steps == 0:
        raise DataError(
            f"evaluation split {loader.reader.files[0].parent if loader.reader.files else ''} has no "
            "examples: AUC and NE would be NaN"
        )
    if max_batches > 0:
        steps = min(steps, max_batches)
    batch = None
    it = iter(loader)
    for _ in range(steps):
        nxt = next(it, None)
        real = nxt is not None
        batch = nxt.to(env.device, non_blocking=True) if real else batch
        if batch is None:
            raise DataError("evaluation split is empty; add examples to data.dir/val and data.dir/test")
        with autocast(env.device, autocast_dtype):
            logits = model(batch).float()
        if real:
            evaluator.update(logits, batch.labels, batch.label_mask)
            if batch.request_id is not None:
                ranking.update(logits, batch.labels, batch.label_mask, batch.request_id)
    model.train()
    return evaluator.compute() | (ranking.compute() if ranking.has_groups() else {})


def score_partition(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    partition: str,
    max_batches: int,
    autocast_dtype: torch.dtype | None,
) -> dict[str, float]:
    """Progressive evaluation of a stream: ``partition``'s metrics before the model trains on it."""
    values = evaluate(model, loader, env, tasks, max_batches, autocast_dtype)
    logger.info("partition %s, scored before training on it: %s", partition, format_metrics(values))
    return values


def stream_summary(run_dir: Path, scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """The mean of every partition's progressive metrics (this run's ``scores`` and, after a restart,
    the earlier ones from metrics.jsonl), and ``<run_dir>/stream_metrics.json`` with each partition's."""
    path = run_dir / "metrics.jsonl"
    earlier = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    every = {
        r["partition"]: {k: v for k, v in r.items() if k not in ("kind", "step", "time", "partition")}
        for r in earlier
        if r.get("kind") == "stream"
    } | scores
    keys = sorted({k for v in every.values() for k, x in v.items() if isinstance(x, (int, float))})
    mean = {k: float(np.nanmean([v.get(k, float("nan")) for v in every.values()])) for k in keys}
    (run_dir / "stream_metrics.json").write_text(json.dumps({"mean": mean, "partitions": every}, indent=1))
    return mean | {"partitions": float(len(every))}


def train(cfg: DictConfig | dict, hooks: Sequence[StepHook] = ()) -> dict[str, float]:
    """Train and evaluate as configured; returns the final test metrics.

    ``cfg`` is the composed Hydra config (configs/train.yaml) or an equivalent dict. Each of
    ``hooks`` is called after every training step as ``hook(step, rank, batch)`` with the batch that
    step trained on (tests use them to log examples or to kill a rank; see tests/faults.py).
    """
    start = time.perf_counter()
    timer = StartupTimer()
    config = validate(cfg)
    if config.trainer.pretrain:
        return train(pretrain_stage(cfg, config), hooks)
    t = config.trainer
    if config.parallelism.compile:
        start_compile_workers()
    with timer.phase("process group"):
        env = init_distributed(
            t.device,
            need_process_group=(config.sparse.backend == "torchrec" and config.sparse.shard)
            or bool(config.parallelism.fully_shard),
        )
    parallel_dims(config, env)  # an impossible layout fails here, on every rank, before any work
    threads = configure_threads(t.num_threads, config.data.num_workers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    run_dir = Path(t.run_dir)
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(config))
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    setup_logging(run_dir if env.is_main else None, env.rank)
    seed_everything(t.seed, t.deterministic)

    with timer.phase("data"):
        source = build_source(config.data, is_writer=env.is_main)
    schema, data_dir = source.schema, source.dir
    check_schema_refs(config, schema)
    logger.info(
        "data: %s (%s), device %s, world size %d", data_dir, ", ".join(schema.tasks), env.device, env.world_size
    )
    logger.info(threads)
    with timer.phase("model build"):
        model = build_model(config, schema, env, timer, source)
    timer.phases["model build"] -= timer.phases.get("sharding", 0.0)
    d = config.data
    loader = lambda split, batch_size, train: split_loader(config, env, source, split, batch_size)  # noqa: E731
    train_loader = loader("train", d.batch_size, True)  # state_dict() / load_state_dict() resume it exactly
    steps_per_epoch = train_loader.steps_per_epoch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"data.batch_size={d.batch_size} x {env.world_size} ranks exceeds the training split "
            f"({train_loader.num_rows()} rows); lower data.batch_size"
        )
    stream = train_loader if isinstance(train_loader, StreamLoader) else None  # data.kind=stream: one pass
    if stream is None and t.max_steps <= 0 and t.epochs * steps_per_epoch < t.min_steps:
        epochs = math.ceil(t.min_steps / steps_per_epoch)
        logger.info(
            "trainer.min_steps=%d: %d epochs of %d steps (trainer.epochs=%d would train %d)",
            t.min_steps,
            epochs,
            steps_per_epoch,
            t.epochs,
            t.epochs * steps_per_epoch,
        )
        t.epochs = epochs  # this run's typed copy of the config
    total_steps = t.max_steps if t.max_steps > 0 else (stream.total_steps() if stream else t.epochs * steps_per_epoch)
    if stream is None:
        check_eval_splits(config, lambda split: loader(split, d.eval_batch_size, False), data_dir)
        if t.eval_every == -1:  # after every epoch (this run's typed copy of the config)
            t.eval_every = steps_per_epoch
    elif t.eval_every:
        raise ConfigError(
            "trainer.eval_every: a stream has no validation split, each partition is scored before "
            "training on it (progressive evaluation); set trainer.eval_every=0"
        )
    apply_transfer(config, model, Path(config.checkpoint.dir or run_dir / "checkpoints"))
    from gem.transfer.student import prepare_teacher  # trainer.distill: the data's teacher columns, or online

    prepare_teacher(config, schema, model, env.device, source.files)
    dense_opt, sparse_opt, scheduler = build_optimizers(model, config.optim, total_steps)
    progress, ckpt = Progress(), None
    if config.checkpoint.enabled:
        with timer.phase("checkpoint load"):
            ckpt = Checkpointer(
                config.checkpoint,
                Path(config.checkpoint.dir or run_dir / "checkpoints"),
                model,
                dense_opt,
                sparse_opt,
                scheduler,
                config_yaml,
                env.rank,
                env.world_size,
                loader=train_loader,
            )
            progress = ckpt.restore() or progress
    if stream is not None:
        stream.check_resume()  # a partition dated before the checkpoint's appeared: stop, naming it
    deltas = build_exporter(
        config, model, dense_opt, sparse_opt, run_dir, env.world_size, progress.step, partitions=stream is not None
    )
    if deltas is not None:
        deltas.start(ckpt, progress)  # the chain's base: a checkpoint of this step
    best = None
    if t.best_metric:
        best = BestWeights(t.best_metric, t.best_mode, run_dir / "best", model, progress.step, env.rank)
        if best.patience_spent(progress.step, t.eval_every, t.best_patience):
            total_steps = progress.step  # the run had stopped early (trainer.best_patience): straight to the test
    task_weights = torch.tensor([t.task_weights.get(k, 1.0) for k in schema.tasks], device=env.device)
    metrics = open_metrics(run_dir, t.loggers, env.is_main, progress.step)
    num_dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch."))
    fused = getattr(model.sparse_arch, "fused_optimizer", None)  # present when TorchRec sharded the tables
    num_fused = len(fused.params) if fused is not None else 0
    logger.info(
        "model: %s, %.2fM dense parameters; sparse backend %s, %d tables with the fused optimizer; %d steps",
        config.model["_target_"],
        num_dense / 1e6,
        config.sparse.backend,
        num_fused,
        total_steps,
    )

    group = dist.group.WORLD if env.world_size > 1 else None
    if getattr(model.dense_arch, "returns_loss", False):  # e.g. gem.models.generative: its own objective
        loss_fn = lambda loss, b: (loss.sum(), loss.detach().reshape(1).expand(len(schema.tasks)))  # noqa: E731
    else:
        loss_fn = distill_loss(config, schema, env, task_weights, group) or (
            lambda logits, b: multitask_bce(logits, b.labels, b.label_mask, task_weights, b.weights, group=group)
        )
    # (the fused table optimizer's zero_grad / step only hand the scheduled learning rate to FBGEMM)
    optimizers = OptimizerSet(
        (dense_opt, sparse_opt, fused), list(model.dense_arch.parameters()), config.optim.grad_clip
    )
    want = config.sparse.pipeline if config.sparse.pipeline is not None else env.device.type == "cuda"
    shared = bool(getattr(model.sparse_arch, "module", model.sparse_arch).routed_id_features)
    pipelined = want and fused is not None and not shared
    reason = "needs TorchRec-sharded tables" if fused is None else "an id feature shares a sequence table"
    logger.info(
        "sparse-dist training pipeline (input all-to-all of batch i+1 overlaps dense compute of batch i): %s",
        "active" if pipelined else f"off ({reason})" if want else "off",
    )
    autocast_dtype = getattr(torch, t.autocast) if t.autocast else None  # validated: "bfloat16"
    train_step = TrainStep(model, loss_fn, optimizers, env.device, pipelined, autocast_dtype)

    peak_tflops = t.peak_tflops if t.peak_tflops is not None else default_peak_tflops(env.device)
    count_flops = lambda b: step_flops(model.dense_arch, b, schema)  # noqa: E731 (host lengths: no device sync)
    on_cuda = env.device.type == "cuda"
    step, window = progress.step, _Window(peak_tflops, on_cuda)
    fallbacks = len(kernel_fallback.events())  # reported so far (the list is the process's)
    profiler = StepProfiler(t.profile, run_dir / "profile", env.rank, progress.step, on_cuda)
    bar = tqdm(
        total=total_steps, initial=step, disable=not (t.progress_bar and env.is_main), desc="train", dynamic_ncols=True
    )
    scores = {}  # a stream's progressive metrics, by partition
    for epoch in range(progress.epoch, stream.num_partitions if stream else t.epochs if t.max_steps <= 0 else 1 << 30):
        train_loader.set_epoch(epoch)  # keeps a restored position in the epoch we resume in
        steps_left = train_loader.steps_per_epoch - sum(train_loader.consumed)  # a stream's partitions differ
        if stream is not None and not any(train_loader.consumed) and step < total_steps:
            train_step.detach()
            scores[stream.partition] = score_partition(
                model,
                loader(stream.partition, d.eval_batch_size, False),
                env,
                schema.tasks,
                stream.partition,
                t.eval_max_batches,
                autocast_dtype,
            )
            metrics.write(
                "stream", step, {"partition": stream.partition, "partition_index": epoch, **scores[stream.partition]}
            )
        batches = TimedIterator(itertools.islice(iter(train_loader), steps_left), count_flops)
        for _ in range(steps_left):
            if step >= total_steps:
                break
            first = step == progress.step
            compile_before = compile_counters() if first else {}
            tick, waited, flops = time.perf_counter(), batches.waited, batches.flops
            per_task, batch_size = train_step(batches)
            scheduler.step()
            step += 1
            if first:
                timer.phases["first batch"] = batches.waited - waited
                timer.compile = compile_breakdown(compile_before, compile_counters())
                _log_startup(timer, time.perf_counter() - tick - (batches.waited - waited), metrics, run_dir, env)
                fallbacks = _log_fallbacks(metrics, step, fallbacks)
            for hook in hooks:
                hook(step, env.rank, train_step.last_batch)
            profiler.step()
            if deltas is not None:  # before the checkpoint: a restart from it never misses this delta
                deltas.maybe_export(
                    step,
                    total_steps,
                    partition_done=stream.partition
                    if stream is not None and sum(train_loader.consumed) == train_loader.steps_per_epoch
                    else None,
                )
            if ckpt is not None:
                seen = progress.examples + (step - progress.step) * d.batch_size * env.world_size
                in_epoch = sum(train_loader.consumed) * d.batch_size * env.world_size
                position = Progress(step, epoch, in_epoch, seen)
                ckpt.maybe_save(position, total_steps)
            bar.update()
            window.add(
                (per_task * task_weights).sum(),
                per_task,
                batch_size * env.world_size,
                batches.waited - waited,
                None if None in (flops, batches.flops) else batches.flops - flops,
            )
            if step % t.log_every == 0 or step == total_steps:
                values = window.summary(schema.tasks, step) | {"lr": scheduler.get_last_lr()[0], "epoch": epoch}
                values |= {f"data/{k}": v for k, v in train_loader.stats.items() if k.startswith(("skipped", "trunc"))}
                values |= id_mapping_counts(model.sparse_arch)  # sparse.ids: collisions, evictions per table
                bar.set_postfix(loss=f"{values['loss']:.4f}")
                logger.info("step %d %s", step, format_metrics(values))
                metrics.write("train", step, values)
                fallbacks = _log_fallbacks(metrics, step, fallbacks)
                window = _Window(peak_tflops, on_cuda)
            if t.eval_every and (step % t.eval_every == 0 or step == total_steps):  # and after the last step
                eval_start = time.perf_counter()
                train_step.detach()
                values = evaluate(
                    model,
                    loader("val", d.eval_batch_size, False),
                    env,
                    schema.tasks,
                    t.eval_max_batches,
                    autocast_dtype,
                )
                logger.info("val step %d %s", step, format_metrics(values))
                metrics.write("val", step, values)
                if best is not None:
                    best.update(step, values)
                    if best.patience_spent(step, t.eval_every, t.best_patience):
                        logger.info(
                            "trainer.best_patience: %d validations without a better %s than step %d's, stopping",
                            t.best_patience,
                            best.metric,
                            best.step,
                        )
                        total_steps = step  # the loops end here
                        if ckpt is not None:  # a restart from it goes straight to the test
                            ckpt.save(position)
                window.start += time.perf_counter() - eval_start  # throughput counts training time only
        if step >= total_steps:
            break
    train_step.detach()
    bar.close()
    profiler.close()
    if profiler.result is not None:
        kinds = profiler.result["frac_of_busy_by_kind"]
        logger.info(
            "profile of steps %s: %.1f ms per step, idle %.0f%%; busy time %s (%s)",
            profiler.result["recorded_steps"],
            profiler.result["ms_per_step"],
            100 * profiler.result["idle_frac"],
            ", ".join(f"{k} {100 * v:.0f}%" for k, v in kinds.items() if v >= 0.005),
            run_dir / "profile",
        )
    if ckpt is not None:
        ckpt.wait()
    if deltas is not None:
        deltas.close()
    if stream is None:
        result = {}
        if best is not None and best.step is not None:
            best.load()
            result = {"best_step": float(best.step), f"best_val/{best.metric}": best.value}
        if t.test:
            test = loader("test", d.eval_batch_size, False)
            result |= evaluate(model, test, env, schema.tasks, t.eval_max_batches, autocast_dtype)
    else:  # the progressive metrics, averaged over the partitions
        result = stream_summary(run_dir, scores) if env.is_main else {}
    result["train_seconds"] = time.perf_counter() - start
    result["steps"] = step
    _log_fallbacks(metrics, step, fallbacks)
    metrics.write("test", step, result)
    metrics.close()
    if env.is_main:
        (run_dir / "test_metrics.json").write_text(json.dumps(result, indent=2))
    logger.info("%s %s", "test" if t.test or stream is not None else "end of training:", format_metrics(result))
    if env.is_main and t.plots:
        plot_curves(run_dir)
    count_finished_run(time.perf_counter() - start)
    return result


def pretrain_stage(cfg: DictConfig | dict, config: Config) -> DictConfig:
    """``trainer.pretrain``: train ``cfg`` with those overrides in ``<run_dir>/pretrain``, checkpointed
    (a restarted run resumes the stage rather than repeating it) and not evaluated unless the
    overrides ask for it (``trainer.eval_every``, ``trainer.test=true``); returns ``cfg`` set to
    start its sparse and dense archs from the stage's last checkpoint."""
    stage_dir = Path(config.trainer.run_dir) / "pretrain"
    raw = OmegaConf.merge(plain_config(cfg), {"trainer": {"pretrain": []}})
    checkpoint = {
        "enabled": True,
        "dir": str(stage_dir / "checkpoints"),
        "at_end": True,
        "resume": True,
        "load_from": None,
    }
    stage = OmegaConf.merge(
        raw,
        # the overrides may ask for evaluations (and a best_metric of the stage's own)
        {"trainer": {"eval_every": 0, "test": False, "best_metric": None, "best_patience": 0}},
        OmegaConf.from_dotlist(list(config.trainer.pretrain)),
        {"trainer": {"run_dir": str(stage_dir)}, "checkpoint": checkpoint},
    )
    logger.info("trainer.pretrain: %s, in %s", " ".join(config.trainer.pretrain), stage_dir)
    train(stage)
    start = {"init_from": str(stage_dir / "checkpoints"), "init_modules": ["sparse_arch", "dense_arch"]}
    return OmegaConf.merge(raw, {"checkpoint": start})


def _log_startup(timer: StartupTimer, first_step_s: float, metrics: MetricsWriter, run_dir: Path, env: DistEnv) -> None:
    """Time to the end of the first step, by phase; the first step itself includes any compile and warm-up,
    broken down when anything was compiled."""
    timer.phases["first step"] = first_step_s
    values = timer.summary()
    logger.info("time to first step %.2fs: %s", values["total"], format_summary(values))
    if env.local_rank == 0 and imported_from_source("torch"):  # the same for every rank of a host
        logger.warning(
            "imports compiled torch's Python sources: no bytecode cache (PYTHONDONTWRITEBYTECODE is set, or "
            "the install folder is read-only and holds none); PYTHONPYCACHEPREFIX=<a writable folder> keeps it "
            "between runs (imports 15 s -> 6 s on a 2-core CPU)"
        )
    metrics.write("startup", 0, values)
    if env.is_main:  # with the kernels that fell back by the end of the first step (kernels.fallback)
        fell_back = [dataclasses.asdict(event) for event in kernel_fallback.events()]
        (run_dir / "startup.json").write_text(json.dumps(values | {"kernel_fallbacks": fell_back}, indent=2))


def _log_fallbacks(metrics: MetricsWriter, step: int, reported: int) -> int:
    """A ``fallback`` row in the metrics for each kernel fallback after the first ``reported``
    (kernels.fallback: the kernel, variant, path taken, error and setting); returns the count."""
    events = kernel_fallback.events()
    for event in events[reported:]:
        metrics.write("fallback", step, dataclasses.asdict(event))
    return len(events)


class _Window:
    """Sums between two log lines, kept on the device so that a step never waits for the GPU;
    ``summary()`` synchronizes once and measures wall time since the window opened."""

    def __init__(self, peak_tflops: float | None = None, cuda: bool = False) -> None:
        self.start = time.perf_counter()
        self.cuda = cuda  # also log the peak device memory
        self.steps, self.examples, self.waited = 0, 0, 0.0
        self.flops: int | None = 0  # this rank's analytic FLOPs (None: the dense arch cannot count them)
        self.peak_tflops = peak_tflops
        self.loss: torch.Tensor | None = None
        self.per_task: torch.Tensor | None = None

    def add(
        self, loss: torch.Tensor, per_task: torch.Tensor, examples: int, waited: float, flops: int | None = None
    ) -> None:
        self.steps += 1
        self.flops = None if flops is None or self.flops is None else self.flops + flops
        self.examples += examples
        self.waited += waited
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        self.per_task = per_task if self.per_task is None else self.per_task + per_task

    def summary(self, tasks: tuple[str, ...], step: int) -> dict[str, float]:
        loss = self.loss.item() / self.steps
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"steps {step - self.steps + 1}..{step}: mean loss is {loss}; lower optim.dense.lr "
                "or set optim.grad_clip"
            )
        seconds = time.perf_counter() - self.start
        out = {"loss": loss}
        out |= {f"{k}/loss": v / self.steps for k, v in zip(tasks, self.per_task.tolist())}
        out |= {
            "examples_per_s": self.examples / seconds,
            "step_ms": 1000 * seconds / self.steps,
            "data_wait_frac": min(1.0, self.waited / seconds),
        }
        if self.flops is not None:  # per rank: TFLOP/s on the true jagged lengths, MFU against the peak
            out |= {"tflops": self.flops / seconds / 1e12, "mfu": mfu(self.flops, seconds, self.peak_tflops)}
        if self.cuda:  # this rank's, since the start
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out
