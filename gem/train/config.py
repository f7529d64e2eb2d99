"""The typed training config: its one source of defaults, and its validation.

The dataclasses below hold every key and its default. They are registered with Hydra as
``gem_schema`` (:func:`register_schema`), the first entry of ``configs/train.yaml``'s defaults,
so composition starts from them and a group option file (``configs/<group>/<option>.yaml``) holds
only what that option changes. :func:`validate` merges the composed config into the dataclasses
once (unknown keys and wrong types fail with the key's full name), then checks the values that
types cannot (with a message naming the key and the fix).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad config value; the message names the key to change."""


def _options(module: str, name: str):
    """A field whose default is the dataclass ``module.name``'s defaults as a dict: the data options
    (gem.data) keep their one source there, and every key is a plain override on the command line."""

    def defaults() -> dict[str, Any]:
        return asdict(getattr(importlib.import_module(module), name)())

    return field(default_factory=defaults)


@dataclass
class DataConfig:
    kind: str = "synthetic"  # a source of gem.data.sources.SOURCES: synthetic | parquet | seqrec | stream
    name: str = "synthetic"
    dir: Optional[str] = None  # synthetic: None = <cache_dir>/<name>-<hash of schema and knobs>
    cache_dir: str = "${oc.env:GEM_CACHE_DIR,.cache/gem}"
    batch_size: int = 256
    eval_batch_size: int = 2048
    num_workers: int = 1
    shuffle: bool = True
    seed: int = 0
    num_examples: dict[str, int] = field(default_factory=lambda: {"train": 300000, "val": 10000, "test": 50000})
    synthetic: dict[str, Any] = _options("gem.data.sources.synthetic", "SyntheticConfig")
    schema: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, Any] = _options("gem.data.format.reader", "LoaderOptions")
    seqrec: dict[str, Any] = _options("gem.data.sources.seqrec", "SeqRecOptions")
    stream: dict[str, Any] = _options("gem.data.sources.stream", "StreamOptions")  # data.kind=stream


@dataclass
class IdSpaceConfig:
    """``sparse.ids.<table>`` (gem/sparse/ids.py, docs/streaming.md "Unbounded ids"): raw ids from a space
    larger than the table (the schema's cardinality) and how they are mapped to its rows."""

    raw_space: int = 2**63  # raw ids lie in [0, raw_space); an id outside is an error naming the feature
    policy: str = "mch"  # mch (TorchRec's managed collisions: a learned id -> row map) | hash | modulo (naive baseline)
    # mch: which mapped id gives up its row to a new one: lru (least recent) | lfu (least frequent) |
    # none (a full table admits no more)
    eviction: str = "lru"
    eviction_interval: int = 1  # mch: training steps between admissions of new ids (and evictions)


@dataclass
class SparseConfig:
    backend: str = "torchrec"  # torchrec | native
    shard: bool = True  # torchrec backend: shard with DistributedModelParallel (fused optimizer)
    sharding_type: Optional[str] = None  # explicit plan: this sharding for every table not in `plan`
    plan: dict[str, str] = field(
        default_factory=dict
    )  # table -> table_wise[:rank] | row_wise | column_wise | table_row_wise[:node] | data_parallel
    constraints: dict[str, list[str]] = field(default_factory=dict)  # planner only: table -> allowed sharding types
    hbm_gb: Optional[float] = None  # planner only: per-rank memory budget for the tables (None: TorchRec's default)
    plan_file: Optional[str] = None  # a plan written by `python -m gem.plan` (its placement, shard by shard)
    sharding_group_size: Optional[int] = None  # CUDA: TorchRec DMPCollection, shard in groups, replicate across
    pipeline: Optional[bool] = None  # TorchRec's TrainPipelineSparseDist (sharded tables only); None: on CUDA
    embedding_dim: int = 32
    init_scale: float = 0.05
    dims: dict[str, int] = field(default_factory=dict)
    ids: dict[str, Any] = field(default_factory=dict)  # table (t_<name>) -> IdSpaceConfig (raw id space, mapping)


@dataclass
class DenseOptimConfig:
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass
class SparseOptimConfig:
    name: str = "rowwise_adagrad"  # rowwise_adagrad | adagrad (element-wise; exact under column-wise sharding)
    lr: float = 0.05
    eps: float = 1e-8
    # L2 decay on the rows a step touches (g += weight_decay * w before the row-wise Adagrad step); 0: off
    weight_decay: float = 0.0


@dataclass
class OptimConfig:
    dense: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    sparse: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    grad_clip: float = 0.0  # 0 = off; clips the dense gradients only


@dataclass
class ProfileConfig:
    """``trainer.profile`` (gem/train/profile.py): torch.profiler over chosen training steps."""

    start: int = 0  # first recorded training step (1-based); 0: off
    steps: int = 5  # how many steps to record
    top: int = 30  # largest kernels listed in the breakdown


@dataclass
class DistillConfig:
    """``trainer.distill`` (docs/transfer.md): mix each task's true labels with a teacher's soft labels."""

    weight: float = 0.0  # w in (1 - w) * BCE(z, y) + w * T^2 * BCE(z / T, sigmoid(t / T)); 0: off
    temperature: float = 1.0  # T, on the logits of both
    tasks: list[str] = field(default_factory=list)  # the distilled tasks; empty: every task
    source: str = "data"  # data: Parquet columns teacher_<task> (python -m gem.transfer.export) | model
    checkpoint: Optional[str] = None  # source=model: the teacher's step_<N> folder (or a folder of them)
    representation: int = 0  # > 0: the student reads the teacher's representation, projected to this width
    adapter: bool = False  # the student's logits: the teacher's, scaled, plus a learned correction


@dataclass
class DeltaExportConfig:
    """``trainer.delta_export`` (gem/train/delta.py, docs/streaming.md): the rows touched since the last
    export plus the dense weights, to ``<run_dir>/deltas/<seq>/``, for a serving system to apply."""

    every: Optional[str] = None  # None: off; "partition": after each streamed partition; "<N>": every N steps
    optimizer_state: bool = False  # also the touched rows' Adagrad momentum and the dense AdamW state
    dir: Optional[str] = None  # None: <trainer.run_dir>/deltas


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    epochs: int = 1
    max_steps: int = -1  # >= 1 stops there; -1: trainer.epochs decides
    # > 0: a training split too small for this many steps in trainer.epochs trains the fewest whole
    # epochs that reach it (a small data set's run; trainer.max_steps and streams ignore it); 0: off
    min_steps: int = 0
    seed: int = 0
    deterministic: bool = False
    log_every: int = 50
    eval_every: int = 0  # steps between validations (and after the last step); 0: none; -1: after every epoch
    # a validation metric (e.g. next_item/ndcg@10, click/auc): test the weights of its best validation,
    # kept in <run_dir>/best (gem/train/best.py), not the last step's; None: the last step's
    best_metric: Optional[str] = None
    best_mode: str = "max"  # max | min (e.g. for click/ne)
    best_patience: int = 0  # > 0: stop once this many validations in a row have not bettered best_metric
    eval_max_batches: int = -1
    test: bool = True  # the final evaluation on the test split (a pretraining stage skips it)
    run_dir: str = "runs/${name}"  # the same explicit path on every torchrun rank
    progress_bar: bool = True
    task_weights: dict[str, float] = field(default_factory=dict)
    peak_tflops: Optional[float] = None  # per device, for MFU; None: by detected GPU (gem/train/flops.py), else no MFU
    autocast: Optional[str] = None  # bfloat16: forward under torch.autocast (loss in float32); None: off
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    num_threads: Optional[int] = None  # torch intra-op threads; None: available CPUs less DataLoader workers
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # jsonl (metrics.jsonl) | tensorboard
    plots: bool = True  # curves.png at the end (needs matplotlib; skipped with a log line without it)
    distill: DistillConfig = field(default_factory=DistillConfig)
    delta_export: DeltaExportConfig = field(default_factory=DeltaExportConfig)
    # key=value overrides of a pretraining stage (e.g. [model.objective=masked_item]): the same config with
    # them trains first in <run_dir>/pretrain, and this run starts its sparse and dense archs from its last step
    pretrain: list[str] = field(default_factory=list)


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1  # -1: world_size / dp_shard (both -1: replicate across nodes, shard inside)
    dp_shard: int = -1  # -1: world_size / dp_replicate
    fully_shard: Optional[bool] = None  # FSDP2 on the dense arch; None: when world_size > 1
    param_dtype: str = "float32"  # FSDP2 compute dtype (bfloat16 on GPUs); parameters stay float32
    reduce_dtype: str = "float32"
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the dense arch (compile_scope says how)
    compile_scope: str = "blocks"  # blocks: a graph per dense block (FSDP2-ready) | dense_arch: one for the whole arch
    reshard_after_forward: bool = True  # False: keep gathered dense blocks from forward to backward
    float8: bool = False  # torchao float8 training of the dense arch's wide projections (docs/e2e.md)
    float8_min_features: int = 512  # float8: Linear layers with both widths >= this (and multiples of 16)
    # Inductor options for the compile (torch.compile's `options`), e.g. +parallelism.inductor.combo_kernels=true;
    # nested keys as torch._inductor.config spells them (triton.cudagraphs); checked against it at start
    inductor: dict[str, Any] = field(default_factory=dict)
    scatter_in_place: Optional[bool] = None  # deprecated: experimental.parallelism.scatter_in_place
    residual_addmm: Optional[bool] = None  # deprecated: experimental.parallelism.residual_addmm
    # > 0: each batch's event rows padded to a multiple of this with empty examples, so the dense arch
    # sees few shapes, as CUDA graphs (+parallelism.inductor.triton.cudagraphs=true) need (docs/e2e.md)
    row_bucket: int = 0


# The kernel settings (kernels.jagged_attention.settings.KernelSettings) that are A/B switches
# for developers, set under experimental.kernels (docs/kernels.md, "Settings"); the others are
# the user's, under kernels.
EXPERIMENTAL_KERNEL_SETTINGS = (
    "tune_space",
    "packed_act",
    "gluon_min_q_len",
    "store_ds_max_mib",
    "gluon_compiled",
)


def _kernels_configs() -> tuple[type, type]:
    """``KernelsConfig`` (``configs/kernels/``: ``attention_backend``, None: Triton on CUDA, the
    reference elsewhere; and the user's fields of ``KernelSettings``) and
    ``ExperimentalKernelsConfig`` (its other fields), each field with its default there, their
    one source. The trainer resolves both once and hands them to the model (:func:`kernel_settings_of`).
    ``KernelsConfig`` still takes each experimental key, deprecated: :func:`validate` moves it."""
    from kernels.jagged_attention.settings import KernelSettings

    user, experimental = [], []
    for f in fields(KernelSettings):
        (experimental if f.name in EXPERIMENTAL_KERNEL_SETTINGS else user).append((f.name, f.type, f.default))
    deprecated = [(name, Optional[kind], None) for name, kind, _ in experimental]
    namespace = {"__module__": __name__}
    return (
        make_dataclass(
            "KernelsConfig", [("attention_backend", Optional[str], None), *user, *deprecated], namespace=namespace
        ),
        make_dataclass("ExperimentalKernelsConfig", experimental, namespace=namespace),
    )


KernelsConfig, ExperimentalKernelsConfig = _kernels_configs()


@dataclass
class ExperimentalParallelismConfig:
    # compile: a row gather's gradient scattered into the dense gradient it is added to, in place, instead of
    # a [T, D] gradient of zeros (gem.distributed.inductor_passes; docs/e2e.md); no effect without
    # parallelism.compile
    scatter_in_place: bool = True
    # compile: Inductor's addmm for `residual + x @ W` (ATen copies the residual into the output first);
    # false: the GEMM, then the add fused into the kernel that reads the sum (gem.distributed.inductor_passes)
    residual_addmm: bool = True


@dataclass
class ExperimentalConfig:
    """Developer switches, kept for A/B measurements (docs/kernels.md, docs/e2e.md): each is
    measured and then made the default or deleted. A run needs none of them."""

    kernels: ExperimentalKernelsConfig = field(default_factory=ExperimentalKernelsConfig)
    parallelism: ExperimentalParallelismConfig = field(default_factory=ExperimentalParallelismConfig)


# Keys that moved under experimental: (section, key) -> still accepted, with a warning.
_MOVED = {("kernels", key) for key in EXPERIMENTAL_KERNEL_SETTINGS} | {
    ("parallelism", "scatter_in_place"),
    ("parallelism", "residual_addmm"),
}


def _reject_deleted_keys(raw: DictConfig) -> None:
    """A ConfigError for a kernel setting that was deleted (``settings.DELETED``), under
    ``experimental.kernels`` or its old place ``kernels``, naming the key and why it went."""
    from kernels.jagged_attention.settings import DELETED, deleted

    for section in ("experimental.kernels", "kernels"):
        node = OmegaConf.select(raw, section, default=None)
        if not isinstance(node, DictConfig):
            continue
        for name in sorted(DELETED):
            if name in node:
                raise ConfigError(deleted(name, f"{section}.{name}"))


def _move_deprecated_keys(config: Config) -> None:
    """Each deprecated ``kernels.<key>`` / ``parallelism.<key>`` that is set goes to
    ``experimental.<section>.<key>``, with a warning naming both."""
    for section, key in sorted(_MOVED):
        value = getattr(getattr(config, section), key)
        if value is None:
            continue
        logger.warning(
            "%s.%s is deprecated and will be removed: it is experimental.%s.%s now (set that); taken as %r",
            section, key, section, key, value,
        )  # fmt: skip
        setattr(getattr(config.experimental, section), key, value)
        setattr(getattr(config, section), key, None)


def kernel_settings_of(config: Config) -> dict:
    """The keys ``kernels.jagged_attention.settings.resolve`` takes: ``kernels.*`` but the
    backend (and the deprecated keys, which :func:`validate` moved), and ``experimental.kernels.*``."""
    skip = {"attention_backend", *EXPERIMENTAL_KERNEL_SETTINGS}
    user = {key: value for key, value in asdict(config.kernels).items() if key not in skip}
    return user | asdict(config.experimental.kernels)


@dataclass
class CheckpointConfig:
    enabled: bool = False
    dir: Optional[str] = None  # None: <trainer.run_dir>/checkpoints
    every_steps: int = 0  # 0: no periodic checkpoints
    at_end: bool = True
    keep_last: int = 3  # 0: keep all
    async_save: bool = False
    resume: bool = True  # continue from the newest checkpoint in dir
    load_from: Optional[str] = None  # a step_<N> folder (or a folder of them) to start from instead
    fallback: bool = True  # a truncated / corrupted newest checkpoint -> the previous one
    verify: str = "checksum"  # checksum | size
    init_from: Optional[str] = None  # another run's step_<N> folder: start the tensors under init_modules from it
    init_modules: list[str] = field(default_factory=list)  # name prefixes, e.g. sparse_arch.ebc.embedding_bags.t_ad_id
    init_frozen: list[str] = field(default_factory=list)  # name prefixes of tensors not trained (docs/transfer.md)


@dataclass
class PlanConfig:
    """``python -m gem.plan`` (gem/plan, docs/planning.md): the cluster to plan for and the step-time
    model's constants. Training ignores it."""

    world_size: int = 8  # ranks (GPUs) to plan for
    gpus_per_node: int = 8
    device: str = "cuda"  # the planner's compute device: cuda | cpu
    hbm_gb: float = 141.0  # GiB per device
    reserve_gb: float = 6.0  # per device, kept free: CUDA context, NCCL buffers, allocator slack
    activations: str = "probe"  # probe (a CPU forward of a few examples) | none
    history_fill: Optional[float] = None  # mean history as a fraction of max_len; None: from the data config / files
    out: Optional[str] = None  # the plan file; None: <trainer.run_dir>/plan.json
    peak_tflops: float = 989.0  # dense bf16 peak per device (H200)
    mfu: float = 0.212  # dense compute efficiency (model FLOPs / peak); calibrated: benchmarks/plan_model.py
    hbm_gbps: float = 4800.0  # device memory bandwidth (H200: 4.8 TB/s)
    embedding_efficiency: float = 0.225  # achieved share of hbm_gbps in the table lookups and updates (calibrated)
    intra_node_gbps: float = 360.0  # achieved all-to-all / collective bandwidth per GPU inside a node (NVLink)
    inter_node_gbps: float = 40.0  # achieved per GPU across nodes (e.g. 400 Gb/s InfiniBand)
    collective_latency_ms: float = 0.71  # exposed per collective call (calibrated on FSDP's all-gathers)
    step_overhead_ms: float = 0.0  # per step: launch gaps, host work the pipeline does not hide
    scaling: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    # sparse.sharding_group_size values to compare at world_size (2-D sparse parallelism); None: the world
    # and 1, 2, 4, 8 x gpus_per_node; []: no comparison
    group_sizes: Optional[list[int]] = None


@dataclass
class Config:
    name: str = "default"
    data: DataConfig = field(default_factory=DataConfig)
    model: Any = None
    sparse: SparseConfig = field(default_factory=SparseConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


SCHEMA = "gem_schema"


def register_schema() -> None:
    """Store :class:`Config` in Hydra's ConfigStore as ``gem_schema`` (configs/train.yaml's first
    default). Runs when this module is imported, which ``python -m gem.train`` and
    :func:`gem.train.api.compose` do before composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=Config)


register_schema()


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}; set {key}={allowed[0]}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def plain_config(cfg: DictConfig | dict) -> DictConfig:
    """``cfg`` as an untyped copy without Hydra's own node (present when composed with
    ``return_hydra_config``), interpolations unresolved. Untyped, so that merging it into the schema
    checks every key (a key Hydra appended with ``+key=value`` to a typed node would otherwise ride along)."""
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"]) if "hydra" in raw else raw
    return OmegaConf.create(OmegaConf.to_container(raw, resolve=False))


def validate(cfg: DictConfig | dict) -> Config:
    """Merge ``cfg`` into the typed schema and check every value; returns the typed config."""
    raw = plain_config(cfg)
    _reject_deleted_keys(raw)
    base = OmegaConf.structured(Config)
    try:
        merged = OmegaConf.merge(base, raw)
        OmegaConf.resolve(merged)
        config: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"config key {key!r}: {e.msg if hasattr(e, 'msg') else e}") from None
    _move_deprecated_keys(config)
    d, s, o, t, p = config.data, config.sparse, config.optim, config.trainer, config.parallelism
    from gem.data.sources import SOURCES

    _one_of("data.kind", d.kind, tuple(SOURCES))
    _positive("data.batch_size", d.batch_size)
    _positive("data.eval_batch_size", d.eval_batch_size)
    _positive("data.num_workers", d.num_workers, allow_zero=True)
    if d.kind == "parquet" and not d.dir:
        raise ConfigError(
            "data.dir is required when data.kind=parquet; set data.dir=/path/to/dataset (with train/ val/ test/)"
        )
    if d.kind == "seqrec" and not d.dir:
        raise ConfigError("data.dir is required when data.kind=seqrec; set data.dir=/folder/with/<data.name>.txt")
    for split in ("train", "test"):
        if d.kind == "synthetic" and d.num_examples.get(split, 0) < 1:
            raise ConfigError(f"data.num_examples.{split} must be >= 1 for synthetic data")
    _one_of("sparse.backend", s.backend, ("torchrec", "native"))
    if s.sharding_type is not None:
        _one_of(
            "sparse.sharding_type",
            s.sharding_type,
            ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"),
        )
    _positive("sparse.embedding_dim", s.embedding_dim)
    _positive("sparse.init_scale", s.init_scale)
    # Untyped in the schema, so that `+sparse.ids.<table>.<key>=...` composes; typed here.
    s.ids = {table: _typed(IdSpaceConfig, ids, f"sparse.ids.{table}") for table, ids in s.ids.items()}
    for table, ids in s.ids.items():
        check_id_space(f"sparse.ids.{table}", ids)
    _positive("optim.dense.lr", o.dense.lr)
    _positive("optim.sparse.lr", o.sparse.lr)
    _one_of("optim.sparse.name", o.sparse.name, ("rowwise_adagrad", "adagrad"))
    _positive("optim.sparse.weight_decay", o.sparse.weight_decay, allow_zero=True)
    if o.sparse.weight_decay and o.sparse.name != "rowwise_adagrad":
        raise ConfigError(
            f"optim.sparse.weight_decay={o.sparse.weight_decay} decays the touched rows inside the row-wise "
            f"Adagrad step, and optim.sparse.name={o.sparse.name!r}; set optim.sparse.name=rowwise_adagrad, "
            "or optim.sparse.weight_decay=0"
        )
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    _one_of("optim.schedule", o.schedule, ("constant", "cosine"))
    _one_of("trainer.device", t.device, ("auto", "cpu", "cuda"))
    _positive("trainer.epochs", t.epochs)
    if t.max_steps != -1 and t.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={t.max_steps}: give a number of steps >= 1, or -1 for trainer.epochs")
    _positive("trainer.min_steps", t.min_steps, allow_zero=True)
    _positive("trainer.log_every", t.log_every)
    if t.eval_every < -1:
        raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (steps), or -1 (after every epoch)")
    _one_of("trainer.best_mode", t.best_mode, ("max", "min"))
    _positive("trainer.best_patience", t.best_patience, allow_zero=True)
    if t.best_patience and not t.best_metric:
        raise ConfigError(
            f"trainer.best_patience={t.best_patience} counts validations without a better trainer.best_metric; "
            "set trainer.best_metric too (e.g. next_item/ndcg@10, click/auc)"
        )
    if t.best_metric and config.data.kind == "stream":
        raise ConfigError(
            f"trainer.best_metric={t.best_metric!r}: a stream has no validation split to pick weights by (each "
            "partition is scored before training on it); unset trainer.best_metric"
        )
    if t.best_metric and not t.eval_every:
        raise ConfigError(
            f"trainer.best_metric={t.best_metric!r} picks the weights of the best validation, and this run "
            "validates only after its last step; set trainer.eval_every=<steps>, or -1 (after every epoch)"
        )
    _positive("trainer.profile.start", t.profile.start, allow_zero=True)
    _positive("trainer.profile.steps", t.profile.steps)
    if t.peak_tflops is not None:
        _positive("trainer.peak_tflops", t.peak_tflops)
    if t.num_threads is not None:
        _positive("trainer.num_threads", t.num_threads)
    for name in t.loggers:
        _one_of("trainer.loggers[]", name, ("jsonl", "tensorboard"))
    if "tensorboard" in t.loggers and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "trainer.loggers has tensorboard but the tensorboard package is not installed; "
            "pip install tensorboard, or set trainer.loggers=[jsonl]"
        )
    if not t.run_dir:
        raise ConfigError("trainer.run_dir must be set (the same path on every rank)")
    for key in ("dp_replicate", "dp_shard"):
        if getattr(p, key) < 1 and getattr(p, key) != -1:
            raise ConfigError(f"parallelism.{key}={getattr(p, key)} must be >= 1, or -1 to fill the world")
    _one_of("parallelism.param_dtype", p.param_dtype, ("float32", "bfloat16", "float16"))
    _one_of("parallelism.reduce_dtype", p.reduce_dtype, ("float32", "bfloat16"))
    _one_of("parallelism.compile_scope", p.compile_scope, ("blocks", "dense_arch"))
    if p.float8 and importlib.util.find_spec("torchao") is None:
        raise ConfigError("parallelism.float8=true needs torchao; pip install torchao, or set parallelism.float8=false")
    _positive("parallelism.float8_min_features", p.float8_min_features)
    if p.row_bucket < 0:
        raise ConfigError(f"parallelism.row_bucket={p.row_bucket} must be >= 0 (0: batches as they come)")
    p.inductor = inductor_options(p.inductor, p.compile)
    if t.autocast is not None:
        _one_of("trainer.autocast", t.autocast, ("bfloat16",))  # float16 would need a GradScaler
    if config.model is None or "_target_" not in config.model:
        raise ConfigError("model must name a dense architecture with _target_; pick one with model=dlrm")
    check_model_args(config.model)
    if config.kernels.attention_backend is not None:
        _one_of("kernels.attention_backend", config.kernels.attention_backend, ("triton", "reference"))
    x = config.experimental.kernels
    _one_of("experimental.kernels.tune_space", x.tune_space, ("default", "wide"))
    for key in ("gluon_min_q_len", "store_ds_max_mib"):
        _positive(f"experimental.kernels.{key}", getattr(x, key), allow_zero=True)
    c = config.checkpoint
    _positive("checkpoint.every_steps", c.every_steps, allow_zero=True)
    _positive("checkpoint.keep_last", c.keep_last, allow_zero=True)
    _one_of("checkpoint.verify", c.verify, ("checksum", "size"))
    if c.init_from and not c.init_modules:
        raise ConfigError(
            f"checkpoint.init_from={c.init_from!r} needs checkpoint.init_modules: the name prefixes to "
            "load, e.g. [sparse_arch.ebc.embedding_bags.t_ad_id] or [sparse_arch]"
        )
    if c.init_modules and not c.init_from:
        raise ConfigError("checkpoint.init_modules is set but checkpoint.init_from is not; give the teacher's step_<N>")
    for override in t.pretrain:
        if "=" not in override or override.startswith(("+", "~")):
            raise ConfigError(
                f"trainer.pretrain: {override!r} is not a key=value override of this config "
                "(e.g. trainer.pretrain=[model.objective=masked_item])"
            )
    if t.pretrain and c.init_from:
        raise ConfigError(
            f"trainer.pretrain starts the run from its pretraining stage, and checkpoint.init_from={c.init_from!r} "
            "from another run: set one of them"
        )
    dd = t.distill
    if not 0 <= dd.weight <= 1:
        raise ConfigError(f"trainer.distill.weight={dd.weight} must be in [0, 1] (0: off, 1: soft labels only)")
    _positive("trainer.distill.temperature", dd.temperature)
    _one_of("trainer.distill.source", dd.source, ("data", "model"))
    _positive("trainer.distill.representation", dd.representation, allow_zero=True)
    if (dd.weight > 0 or dd.representation > 0 or dd.adapter) and dd.source == "model" and not dd.checkpoint:
        raise ConfigError(
            "trainer.distill.source=model needs trainer.distill.checkpoint=<the teacher's step_<N> folder>"
        )
    every = t.delta_export.every
    if every is not None and every != "partition" and not (every.isdigit() and int(every) > 0):
        raise ConfigError(
            f"trainer.delta_export.every={every!r} must be partition, a number of steps > 0, or null (off)"
        )
    check_plan(config.plan)
    return config


def _typed(cls: type, value: Any, key: str) -> Any:
    """``value`` (a dict) merged into the dataclass ``cls``; a bad key or type names ``key``."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), value))
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key '{key}.{e.full_key}': {e.msg}") from None


def inductor_options(options: dict[str, Any], compile: bool) -> dict[str, Any]:
    """``parallelism.inductor`` as torch.compile's ``options``: nested keys joined with dots
    (``{"triton": {"cudagraphs": True}}`` -> ``"triton.cudagraphs"``), each checked to be one of
    ``torch._inductor.config``'s, so that a misspelt key stops the run at start and not at the first
    step's compile. Without ``compile`` there is nothing to apply them to: they are dropped with a
    warning (an experiment's options, e.g. gem_base_h200's CUDA graphs, under
    ``parallelism.compile=false``)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", options)
    if not flat:
        return flat
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    for key in flat:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"parallelism.inductor.{key} is not an option of torch._inductor.config{hint}")
    if not compile:
        logger.warning("parallelism.inductor (%s) ignored: parallelism.compile=false", ", ".join(sorted(flat)))
        return {}
    return flat


def check_id_space(key: str, ids: IdSpaceConfig) -> None:
    """One ``sparse.ids.<table>`` entry; the table names are checked against the schema when the
    SparseArch is built (gem.sparse.ids.build_id_spaces)."""
    if not 1 <= ids.raw_space <= 2**63:
        raise ConfigError(
            f"{key}.raw_space={ids.raw_space} must be in [1, 2**63] (ids are int64); "
            f"e.g. {key}.raw_space=9223372036854775808"
        )
    _one_of(f"{key}.policy", ids.policy, ("mch", "hash", "modulo"))
    _one_of(f"{key}.eviction", ids.eviction, ("lru", "lfu", "none"))
    _positive(f"{key}.eviction_interval", ids.eviction_interval)


def check_plan(p: PlanConfig) -> None:
    """The plan.* values (``python -m gem.plan``)."""
    _positive("plan.world_size", p.world_size)
    _positive("plan.gpus_per_node", p.gpus_per_node)
    if p.world_size > p.gpus_per_node and p.world_size % p.gpus_per_node:
        raise ConfigError(
            f"plan.world_size={p.world_size} is not a whole number of nodes of plan.gpus_per_node="
            f"{p.gpus_per_node}; set plan.world_size={p.world_size // p.gpus_per_node * p.gpus_per_node}"
        )
    _one_of("plan.device", p.device, ("cuda", "cpu"))
    _one_of("plan.activations", p.activations, ("probe", "none"))
    for key in ("hbm_gb", "peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
        _positive(f"plan.{key}", getattr(p, key))
    for key in ("reserve_gb", "collective_latency_ms", "step_overhead_ms"):
        _positive(f"plan.{key}", getattr(p, key), allow_zero=True)
    for key in ("mfu", "embedding_efficiency"):
        if not 0 < getattr(p, key) <= 1:
            raise ConfigError(f"plan.{key}={getattr(p, key)} must be in (0, 1]")
    if p.reserve_gb >= p.hbm_gb:
        raise ConfigError(f"plan.reserve_gb={p.reserve_gb} leaves nothing of plan.hbm_gb={p.hbm_gb}")
    if p.history_fill is not None and not 0 <= p.history_fill <= 1:
        raise ConfigError(f"plan.history_fill={p.history_fill} must be in [0, 1] (a fraction of max_len)")
    if not p.scaling or any(n < 1 for n in p.scaling):
        raise ConfigError(f"plan.scaling={p.scaling} must list GPU counts >= 1")
    if p.group_sizes is not None and any(n < 1 for n in p.group_sizes):
        raise ConfigError(f"plan.group_sizes={p.group_sizes} must list group sizes >= 1")


# Sizes of gem's dense archs (configs/model/*.yaml), checked by name wherever a gem.models arch has them.
_MODEL_POSITIVE = ("dim", "num_heads", "head_dim", "pffn_kv")  # widths and counts a division needs
_MODEL_NON_NEGATIVE = (
    "num_layers",
    "num_summary",
    "num_pma",
    "num_recent",
    "num_seeds",
    "num_pooled",
    "in_batch_negatives",
)  # 0 builds (no layers / no such tokens / off)
_MODEL_WIDTHS = ("bottom_mlp", "top_mlp", "tower_mlp")  # lists of hidden widths
_WUKONG_POSITIVE = ("rank", "hidden", "num_experts")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_arg(key: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ConfigError(f"{key} must be {what}{' or null' if optional else ''}, got {value!r}")


def check_model_args(model: dict) -> None:
    """Model arguments checked by their full key, before the arch is built (a bad size would
    otherwise fail deep inside it, e.g. ``model.num_heads=0``: "integer division or modulo by zero").

    Only gem's own archs (``_target_`` under ``gem.models.``): their sizes are positive (``dim``,
    ``num_heads``, ``head_dim``, ``pffn_kv``, the MLP widths, ``wukong.rank / hidden /
    num_experts``) or non-negative (layer and token counts, ``window``), ``head_dim`` is even
    (rotary embeddings rotate channel pairs), ``temperature > 0`` and ``0 <= dropout < 1``.
    """
    if not str(model.get("_target_", "")).startswith("gem.models."):
        return
    for key in _MODEL_POSITIVE:
        if key in model:
            _int_arg(f"model.{key}", model[key], 1)
    for key in _MODEL_NON_NEGATIVE:
        if key in model:
            _int_arg(f"model.{key}", model[key], 0)
    if "window" in model:
        _int_arg("model.window", model["window"], 0, optional=True)
    for key in _MODEL_WIDTHS:
        widths = model.get(key)
        if widths is None:
            continue
        if not isinstance(widths, (list, tuple)):
            raise ConfigError(f"model.{key} must be a list of layer widths, got {widths!r}; e.g. model.{key}=[128,64]")
        for i, width in enumerate(widths):
            if not _is_int(width) or width < 1:
                raise ConfigError(
                    f"model.{key}[{i}] must be a positive integer (a layer width), got {width!r}; "
                    f"model.{key}={list(widths)}"
                )
    wukong = model.get("wukong") or {}
    for key in _WUKONG_POSITIVE:
        if key in wukong:
            _int_arg(f"model.wukong.{key}", wukong[key], 1)
    if "num_lcb" in wukong:
        _int_arg("model.wukong.num_lcb", wukong["num_lcb"], 0, optional=True)
    streams = model.get("streams") or {}
    for name, stream in streams.items():
        if not isinstance(stream, dict):
            raise ConfigError(
                f"model.streams.{name} must be a mapping such as {{num_heads: 4, head_dim: 32}}, got {stream!r}"
            )
        for key in ("num_heads", "head_dim"):
            if key in stream:
                _int_arg(f"model.streams.{name}.{key}", stream[key], 1)
        if "window" in stream:
            _int_arg(f"model.streams.{name}.window", stream["window"], 0, optional=True)
    for prefix, node in [("model", model)] + [(f"model.streams.{n}", st) for n, st in streams.items()]:
        head_dim = node.get("head_dim")
        if _is_int(head_dim) and head_dim % 2:
            raise ConfigError(
                f"{prefix}.head_dim must be even (rotary position embeddings rotate pairs of channels), "
                f"got {head_dim}; set {prefix}.head_dim={head_dim + 1}"
            )
    if "temperature" in model:
        t = model["temperature"]
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ConfigError(f"model.temperature must be a number > 0, got {t!r}; e.g. model.temperature=0.05")
    if "dropout" in model:
        p = model["dropout"]
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
            raise ConfigError(f"model.dropout must be in [0, 1), got {p!r}; e.g. model.dropout=0.1")


def check_schema_refs(config: Config, schema) -> None:
    """Checks that need the feature schema: task names in trainer.task_weights."""
    for task in config.trainer.task_weights:
        if task not in schema.tasks:
            raise ConfigError(
                f"trainer.task_weights.{task}: unknown task; the schema (data.schema.tasks) has {list(schema.tasks)}"
            )
