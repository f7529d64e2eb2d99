"""The one set-up path of a run, in stages: environment, data, model, optimizers, loaders.

``train(cfg)`` builds them all (:func:`build`); the library API (gem.train.api) hands out the same
stages one by one for a custom loop. Nothing here trains: see gem.train.trainer.

    env = environment(config)                         # device, process group, threads, seed
    source = data(config, env)                        # the data set (rank 0 prepares it)
    model = build_model(config, source.schema, env, source=source)
    initialize(config, model, checkpoint_dir(config))  # checkpoint.init_from / init_frozen
    optimizers = Optimizers(model, config, total_steps)
    loader = split_loader(config, env, source, "train")
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from gem.data.errors import DataError
from gem.data.pipeline.loader import BatchLoader
from gem.data.pipeline.schema import FeatureSchema
from gem.data.sources import DataSource, build_source
from gem.data.sources.stream import StreamLoader
from gem.models.capabilities import capabilities
from gem.models.gem import GEMModel
from gem.sparse.arch import SparseArch
from gem.train.checkpoint import CheckpointError
from gem.train.config import Config, ConfigError, check_schema_refs, kernel_settings_of
from gem.train.logging import logger
from gem.train.optim import build_optimizers
from gem.train.startup import StartupTimer, configure_threads
from gem.train.step import OptimizerSet

# (schema, feature_dims, build) -> the dense arch: build(schema=, feature_dims=) itself, or a module
# around it (a component's, e.g. gem.transfer's students)
DenseBuilder = Callable[[FeatureSchema, dict, Callable[..., nn.Module]], nn.Module]


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    threads: str = ""  # how torch's threads were set (environment(); logged with the data)

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


def parallel_dims(config: Config, env: DistEnv):
    """The checked data-parallel layout (gem.distributed.ParallelDims); a bad one is a ConfigError."""
    from gem.distributed.parallel_dims import ParallelDims, ParallelLayoutError

    p = config.parallelism
    try:
        return ParallelDims(p.dp_replicate, p.dp_shard, env.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
    except ParallelLayoutError as e:
        raise ConfigError(str(e)) from None


def environment(config: Config, timer: StartupTimer | None = None) -> DistEnv:
    """The process's device and ranks (a process group where torchrun or TorchRec sharding needs
    one), the data-parallel layout checked on every rank before any work, torch's threads
    (``env.threads`` says how) and every random generator seeded (``trainer.seed``)."""
    t = config.trainer
    with (timer or StartupTimer()).phase("process group"):
        env = init_distributed(
            t.device,
            need_process_group=(config.sparse.backend == "torchrec" and config.sparse.shard)
            or bool(config.parallelism.fully_shard),
        )
    parallel_dims(config, env)  # an impossible layout fails here, on every rank
    env.threads = configure_threads(t.num_threads, config.data.num_workers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    seed_everything(t.seed, t.deterministic)
    return env


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def data(config: Config, env: DistEnv) -> DataSource:
    """The data set of ``config.data`` (gem.data.build_source: rank 0 prepares it), its schema
    checked against the keys that name its tasks and features."""
    source = build_source(config.data, is_writer=env.is_main)
    check_schema_refs(config, source.schema)
    return source


def load_data(config: Config, env: DistEnv) -> tuple[FeatureSchema, Path]:
    """The schema and the data set folder of ``data`` (gem.data.build_source; rank 0 prepares it)."""
    source = build_source(config.data, is_writer=env.is_main)
    return source.schema, source.dir


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


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


def check_kernels(config: Config, env: DistEnv) -> None:
    """``kernels=triton`` (``kernels.attention_backend=triton``) asks for the Triton kernels, which
    run on a CUDA GPU (or in Triton's interpreter, ``TRITON_INTERPRET=1``); on another device it is
    a ConfigError naming the fix, before the model is built, rather than a fallback per kernel."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as Triton (and kernels/) read it
    if config.kernels.attention_backend != "triton" or env.device.type == "cuda" or interpret:
        return
    where = "the run is on the CPU (trainer.device=cpu)" if torch.cuda.is_available() else "this machine has none"
    raise ConfigError(
        f"kernels=triton (kernels.attention_backend=triton) runs the attention on Triton kernels, which need "
        f"a CUDA GPU, and {where}: use kernels=reference (or kernels=auto: Triton on a GPU, the reference elsewhere)"
    )


def build_model(
    config: Config,
    schema: FeatureSchema,
    env: DistEnv,
    timer: StartupTimer | None = None,
    source: DataSource | None = None,
    dense_builder: DenseBuilder | None = None,
) -> GEMModel:
    """SparseArch (TorchRec-sharded or not) + the configured dense arch, materialized on ``env.device``,
    then ``parallelize_gem`` (FSDP2 / HSDP on the ParallelDims mesh when ``world_size > 1``). A
    dense arch whose capabilities ask for the training split's item co-occurrence gets it from
    ``source``. ``dense_builder``: a component's wrapper around the configured dense arch."""
    from gem.distributed.parallel_dims import dtype_from_name
    from gem.distributed.parallelize import parallelize_gem
    from gem.models.sequence import use_kernel_settings
    from kernels.jagged_attention import settings as kernel_settings

    check_kernels(config, env)
    # the config's kernel settings (then the debugging variables'), handed to the model's attention
    # modules below, not installed for the process
    attention_settings = kernel_settings.resolve(**kernel_settings_of(config))
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
        from gem.train.initialize import frozen_tables

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
                    frozen_tables=frozen_tables(sparse, config.checkpoint.init_frozen),
                    weight_decay=config.optim.sparse.weight_decay,
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
            if dense_builder is not None:
                dense = dense_builder(schema, feature_dims, build)
            else:
                dense = build(schema=schema, feature_dims=feature_dims)
    except (DataError, CheckpointError):
        raise
    except Exception as e:  # Hydra wraps constructor errors; name the config node.
        raise ConfigError(f"model: could not build {config.model.get('_target_')}: {e}") from e
    dense.to_empty(device=env.device)
    dense.init_weights()  # the same on every rank (same seed): fully_shard keeps each rank's slice
    use_kernel_settings(dense, attention_settings)  # before compile, which traces them
    can = capabilities(dense)
    if can.item_cooccurrence:  # a seqrec ranking prior, from the training split (docs/seqrec.md)
        if source is None:
            raise ConfigError("model.cooccurrence needs the training split: build the model with its data source")
        from gem.data.sources.seqrec import item_cooccurrence

        keys, values = item_cooccurrence(source.files("train"), dense.num_items, dense.item_feature)
        dense.set_cooccurrence(torch.from_numpy(keys), torch.from_numpy(values))
    if p.row_bucket and can.reads_more_than_embeddings:
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
        scatter_in_place=config.experimental.parallelism.scatter_in_place,
        residual_addmm=config.experimental.parallelism.residual_addmm,
    )


def checkpoint_dir(config: Config, run_dir: Path | str | None = None) -> Path:
    """Where the run's checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints`` (``run_dir``
    defaults to ``trainer.run_dir``)."""
    return Path(config.checkpoint.dir or Path(run_dir or config.trainer.run_dir) / "checkpoints")


def one_dense_builder(dense_builders: Sequence[DenseBuilder]) -> DenseBuilder | None:
    """The components' wrapper around the dense arch, if any; more than one is a ConfigError."""
    if len(dense_builders) > 1:
        raise ConfigError(f"{len(dense_builders)} components wrap the dense arch; at most one may")
    return dense_builders[0] if dense_builders else None


def initialize(config: Config, model: nn.Module, ckpt_dir: Path) -> None:
    """Parameter sharing (``checkpoint.init_from`` / ``init_modules``) and freezing (``init_frozen``),
    before the optimizers are built. Resuming the run's own checkpoint takes precedence: then the
    shared tensors come from that checkpoint and ``init_from`` is not read."""
    c = config.checkpoint
    if not (c.init_from or c.init_frozen):
        return
    from gem.train.checkpoint import list_checkpoints
    from gem.train.initialize import freeze, init_from_checkpoint

    resuming = c.enabled and (c.load_from or (c.resume and list_checkpoints(ckpt_dir)))
    if c.init_from and resuming:
        logger.info("checkpoint.init_from: not read, the run resumes from its own checkpoint")
    elif c.init_from:
        init_from_checkpoint(model, c.init_from, c.init_modules)
    freeze(model, c.init_frozen)


# ---------------------------------------------------------------------------------------------
# optimizers
# ---------------------------------------------------------------------------------------------


class Optimizers:
    """Every optimizer of a model behind ``zero_grad()`` / ``step()``: AdamW for the dense
    parameters (with ``optim.grad_clip``), Adagrad for the tables that are not fused into backward,
    TorchRec's fused table optimizer (updated inside ``loss.backward()``; ``step()`` hands it the
    scheduled learning rate), and the learning-rate schedule, stepped after them. ``set`` is the
    optimizers without the schedule, as TorchRec's pipeline drives them."""

    def __init__(self, model: nn.Module, config: Config, total_steps: int) -> None:
        self.dense, self.sparse, self.schedule = build_optimizers(model, config.optim, total_steps)
        self.fused = getattr(model.sparse_arch, "fused_optimizer", None)  # where TorchRec sharded the tables
        self.set = OptimizerSet(
            (self.dense, self.sparse, self.fused), list(model.dense_arch.parameters()), config.optim.grad_clip
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.set.zero_grad(set_to_none)

    def step(self) -> None:
        self.set.step()
        self.schedule.step()

    @property
    def lr(self) -> float:
        """The dense learning rate the next step uses."""
        return self.schedule.get_last_lr()[0]


# ---------------------------------------------------------------------------------------------
# the whole run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How long a run trains and when it validates, derived from the config and the data (the
    config itself is never changed)."""

    steps_per_epoch: int
    epochs: int  # a stream: its partitions
    total_steps: int
    eval_every: int  # 0: no validation during training


@dataclass
class Run:
    """What :func:`build` made for one training run."""

    config: Config
    env: DistEnv
    source: DataSource
    model: GEMModel
    optimizers: Optimizers
    train_loader: BatchLoader  # state_dict() / load_state_dict() resume it exactly
    plan: Plan
    run_dir: Path
    timer: StartupTimer

    @property
    def stream(self) -> StreamLoader | None:
        """The training loader of ``data.kind=stream`` (one pass over day partitions), else None."""
        return self.train_loader if isinstance(self.train_loader, StreamLoader) else None

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.config, self.run_dir)

    def loader(self, split: str, batch_size: int | None = None) -> BatchLoader:
        return split_loader(self.config, self.env, self.source, split, batch_size)


def plan(
    config: Config, loader: BatchLoader, world_size: int, data_dir: Path, eval_rows: Callable[[str], tuple[int, str]]
) -> Plan:
    """The run's length and validation interval. ``eval_rows(split)``: the split's row count and
    what to say of it when there are none. A split too small for ``trainer.min_steps`` trains more
    epochs; a missing or empty validation split turns validation off with a warning (its AUC / NE
    would be NaN), or fails with ``trainer.best_metric``; a missing or empty test split fails now
    rather than after training, unless ``trainer.test`` is off."""
    d, t = config.data, config.trainer
    steps_per_epoch = loader.steps_per_epoch
    if steps_per_epoch == 0 and loader.num_rows() == 0:
        raise DataError(f"the training split {data_dir / 'train'} holds no rows: write examples into its files")
    if steps_per_epoch == 0:
        raise ConfigError(
            f"data.batch_size={d.batch_size} x {world_size} ranks exceeds the training split "
            f"({loader.num_rows()} rows); lower data.batch_size"
        )
    if isinstance(loader, StreamLoader):  # data.kind=stream: one pass over its partitions
        if t.eval_every:
            raise ConfigError(
                "trainer.eval_every: a stream has no validation split, each partition is scored before "
                "training on it (progressive evaluation); set trainer.eval_every=0"
            )
        total = t.max_steps if t.max_steps > 0 else loader.total_steps()
        return Plan(steps_per_epoch, loader.num_partitions, total, 0)
    epochs = t.epochs
    if t.max_steps <= 0 and epochs * steps_per_epoch < t.min_steps:
        epochs = math.ceil(t.min_steps / steps_per_epoch)
        logger.info(
            "trainer.min_steps=%d: %d epochs of %d steps (trainer.epochs=%d would train %d)",
            t.min_steps,
            epochs,
            steps_per_epoch,
            t.epochs,
            t.epochs * steps_per_epoch,
        )
    total = t.max_steps if t.max_steps > 0 else epochs * steps_per_epoch
    eval_every = t.eval_every
    if eval_every:
        rows, why = eval_rows("val")
        if rows == 0 and t.best_metric:
            raise DataError(
                f"trainer.best_metric={t.best_metric!r} picks weights by validation, and the "
                f"validation split {data_dir / 'val'} {why}: add examples there or unset trainer.best_metric"
            )
        if rows == 0:
            logger.warning(
                "trainer.eval_every=%d but the validation split %s %s: training without validation; add "
                "examples there or set trainer.eval_every=0",
                t.eval_every,
                data_dir / "val",
                why,
            )
            eval_every = 0
    if not t.eval_every:  # no validation asked for: a missing split is only worth a word
        rows, why = eval_rows("val")
        if rows == 0:
            logger.warning("the validation split %s %s: this run validates nothing", data_dir / "val", why)
    if t.test:
        rows, why = eval_rows("test")
        if rows == 0:
            raise DataError(
                f"the test split {data_dir / 'test'} {why}; the run would end on NaN metrics: add examples there "
                "or set trainer.test=false"
            )
    if eval_every == -1:  # after every epoch
        eval_every = steps_per_epoch
    return Plan(steps_per_epoch, epochs if t.max_steps <= 0 else 1 << 30, total, eval_every)


def _rows(loader_of: Callable[[str], BatchLoader]) -> Callable[[str], tuple[int, str]]:
    """``eval_rows`` of :func:`plan`: a split's row count, and what to say of it when there are none."""

    def rows(split: str) -> tuple[int, str]:
        try:
            return loader_of(split).num_rows(), "has no examples"
        except FileNotFoundError as e:
            return 0, f"is missing ({e})"

    return rows


def build(
    config: Config,
    env: DistEnv,
    run_dir: Path,
    timer: StartupTimer,
    dense_builders: Sequence[DenseBuilder] = (),
) -> Run:
    """Data, model (``dense_builders``: the components' wrappers, at most one), the training loader
    and plan, the parameters shared or frozen (``checkpoint.init_*``), the optimizers."""
    dense_builder = one_dense_builder(dense_builders)
    with timer.phase("data"):
        source = data(config, env)
    logger.info(
        "data: %s (%s), device %s, world size %d",
        source.dir,
        ", ".join(source.schema.tasks),
        env.device,
        env.world_size,
    )
    logger.info(env.threads)
    with timer.phase("model build"):
        model = build_model(config, source.schema, env, timer, source, dense_builder)
    timer.phases["model build"] -= timer.phases.get("sharding", 0.0)
    train_loader = split_loader(config, env, source, "train")
    eval_rows = _rows(lambda split: split_loader(config, env, source, split))
    run_plan = plan(config, train_loader, env.world_size, source.dir, eval_rows)
    initialize(config, model, checkpoint_dir(config, run_dir))
    optimizers = Optimizers(model, config, run_plan.total_steps)
    return Run(config, env, source, model, optimizers, train_loader, run_plan, run_dir, timer)
