"""``make_plan(cfg)``: the placement of every table shard and the memory of every rank, for a cluster
of ``plan.world_size`` GPUs, computed on one CPU.

What each figure is (per rank, bytes; docs/planning.md has the worked example):

- **tables**: the fp32 rows and columns of each shard TorchRec's planner places on the rank
  (``EmbeddingShardingPlanner.plan`` for a ``Topology`` of the configured size, on a meta-device
  SparseArch: nothing is allocated); data-parallel tables count on every rank.
- **table optimizer**: row-wise Adagrad keeps one float per row of each shard (per column
  shard too), element-wise Adagrad one per weight, Adam two per weight. Data-parallel tables also
  hold a full gradient.
- **UVM tables**: a shard TorchRec's planner puts in host memory (``fused_uvm``, or
  ``fused_uvm_caching`` when no HBM is left for it) counts there, in a host-memory report outside
  the budget, weights and optimizer state; in HBM only the caching kernels' cache (the planner's
  cache load factor, 0.2, of both), as the planner itself sized it.
- **embedding I/O**: the looked-up embeddings a rank receives for its batch and their gradients
  (the all-to-all buffers), ``2 x 4 x (B x pooled dims + tokens x sequence dims)``.
- **dense**: parameters, gradients and AdamW's two moments in fp32, each divided by
  ``dp_shard`` (FSDP2 / HSDP from ``parallelism.*``), plus the gathered blocks in the compute
  dtype (two blocks at a time with ``reshard_after_forward``, all of them without).
- **activations**: what one forward saves for backward, measured by a probe: the configured dense
  arch runs a forward of a few examples at the mean history length on the CPU, under
  ``saved_tensors_hooks``, with the attention counted as the Triton kernel saves it (q, k, v, o
  and the softmax statistics, not the reference's padded scores); scaled to the batch, to the
  compute dtype (bf16: half), to activation checkpointing (block inputs plus one block), plus one
  block as the backward's working set.
- **reserve**: ``plan.reserve_gb`` for the CUDA context, NCCL buffers and allocator slack.

The tables' budget handed to the planner is what the rest leaves of ``plan.hbm_gb``, so that
the planner places tables where they fit beside the dense part. The plan file (JSON) holds the
placement shard by shard (``sharding``), which ``sparse.plan_file=<path>`` makes a run use, and
this report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gem.data.pipeline.schema import FeatureSchema
from gem.train.config import Config, ConfigError

GiB = 1024**3
PROBE_EXAMPLES = 4
PROBE_CARDINALITY = 1024  # the probe's tables: lookups give the same shapes with fewer rows
# Optimizer state of one table shard of rows x cols (bytes), by optim.sparse.name.
SPARSE_STATE = {
    "rowwise_adagrad": lambda rows, cols: 4 * rows,
    "adagrad": lambda rows, cols: 4 * rows * cols,
    "adam": lambda rows, cols: 8 * rows * cols,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Lengths:
    """History lengths per sequence group: a sample (``[n]`` each) and where it came from."""

    sample: dict[str, np.ndarray]
    source: str

    def mean(self, group: str) -> float:
        return float(self.sample[group].mean()) if self.sample[group].size else 0.0


@dataclass
class Activations:
    """Bytes a forward saves for backward, per example, at the probe's (fp32) precision."""

    blocks: list[float]  # saved inside each dense block
    block_inputs: list[float]  # each block's inputs (what checkpointing keeps)
    outside: float  # saved outside the blocks (sparse arch, heads' glue)
    probe_length: dict[str, int] = field(default_factory=dict)

    def per_example(self, checkpointing: bool) -> float:
        top = max(self.blocks, default=0.0)
        kept = sum(self.block_inputs) + top if checkpointing else sum(self.blocks)
        return kept + self.outside + top  # + one block: the backward's working set


@dataclass
class Plan:
    """What :func:`make_plan` found; ``text()`` is the report, ``to_json()`` the plan file."""

    config: Config
    world_size: int
    local_size: int
    schema: FeatureSchema
    sharding: dict  # gem.distributed.sharding.plan_to_dict
    lengths: Lengths
    dense_params: int
    block_params: list[int]
    dims: Any  # ParallelDims
    fsdp: bool
    memory: dict[str, np.ndarray]  # component -> bytes per rank [world_size]
    flops_per_step: float | None  # dense forward + backward per rank at the configured batch
    flops_source: str
    activations: Activations | None
    activation_note: str
    warnings: list[str]
    step_time: Any = None  # gem.plan.steptime.StepTimeTable, filled by __main__
    forward_flops: float | None = None  # the forward's share (recomputed under activation checkpointing)
    group_size: int | None = None  # sparse.sharding_group_size: tables sharded in groups of this many ranks
    groups: Any = None  # gem.plan.steptime.GroupComparison, filled by __main__
    # component -> host bytes per rank [world_size]: tables TorchRec keeps in UVM; not in the budget
    host_memory: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def sharding_world(self) -> int:
        """Ranks the tables are sharded over: the sharding group's, else the world's."""
        return self.group_size or self.world_size

    @property
    def budget(self) -> float:
        p = self.config.plan
        return (p.hbm_gb - p.reserve_gb) * GiB

    def total(self) -> np.ndarray:
        return sum(self.memory.values())

    def text(self) -> str:
        return format_report(self)

    def to_json(self) -> dict:
        mem = {k: _stats(v) for k, v in self.memory.items()}
        mem["total"] = _stats(self.total())
        p = self.config.plan
        out = {
            "sharding": self.sharding,
            "cluster": {
                "world_size": self.world_size,
                "gpus_per_node": self.local_size,
                "device": p.device,
                "hbm_gb": p.hbm_gb,
                "reserve_gb": p.reserve_gb,
            },
            "model": {
                "target": self.config.model.get("_target_"),
                "dense_params": self.dense_params,
                "dense_layout": self.dims.describe() if self.fsdp else "not sharded",
                "batch_per_rank": self.config.data.batch_size,
                "mean_history": {g: self.lengths.mean(g) for g in self.lengths.sample},
                "flops_per_step": self.flops_per_step,
                "flops_source": self.flops_source,
            },
            "memory_bytes": mem,
            "memory_bytes_per_rank": {k: v.tolist() for k, v in self.memory.items()} if self.world_size <= 64 else None,
            "host_memory_bytes": {k: _stats(v) for k, v in self.host_memory.items()},
            "warnings": self.warnings,
        }
        out["cluster"]["sharding_group_size"] = self.group_size
        if self.step_time is not None:
            out["step_time"] = self.step_time.to_json()
        if self.groups is not None:
            out["sharding_groups"] = self.groups.to_json()
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path


def _stats(v: np.ndarray) -> dict:
    return {"min": int(v.min()), "max": int(v.max()), "mean": float(v.mean()), "max_rank": int(v.argmax())}


# -- inputs: schema, lengths -----------------------------------------------------------------------


def plan_schema(config: Config) -> tuple[FeatureSchema, Path | None]:
    """The run's feature schema without generating data: synthetic from ``data.schema``; Parquet
    from ``data.schema`` or the train split's footers."""
    from gem.data.sources import build_source, dataset_schema

    d = config.data
    if d.kind == "synthetic" and not d.dir:  # not generated just to plan
        return dataset_schema(d, None), None
    source = build_source(d)
    return source.schema, source.dir


def history_lengths(
    config: Config, schema: FeatureSchema, directory: Path | None, n: int = 100_000, seed: int = 0
) -> Lengths:
    """A sample of ``n`` history lengths per sequence group: ``plan.history_fill`` x max_len if
    set; the synthetic generator's lognormal (capped at max_len, with its empty share); else the
    lengths in the train split's files."""
    from gem.data.sources.synthetic import SyntheticConfig

    groups = schema.sequence_groups
    fill = config.plan.history_fill
    if fill is not None:
        return Lengths(
            {g.name: np.full(n, round(fill * g.max_len), dtype=np.int64) for g in groups},
            f"plan.history_fill={fill} x max_len",
        )
    rng = np.random.default_rng(seed)
    if config.data.kind == "synthetic" and directory is None:
        k = SyntheticConfig(**config.data.synthetic)
        out = {}
        for g in groups:
            lengths = np.minimum(np.round(rng.lognormal(k.history_log_mean, k.history_log_std, n)), g.max_len)
            lengths[rng.random(n) < k.empty_history_rate] = 0
            out[g.name] = lengths.astype(np.int64)
        return Lengths(
            out,
            f"the synthetic generator: lognormal({k.history_log_mean}, {k.history_log_std}) capped "
            f"at max_len, {k.empty_history_rate:.0%} empty",
        )
    import pyarrow.parquet as pq

    from gem.data.format.dataset import split_files

    out = {}
    files = split_files(directory, "train")
    for g in groups:
        found, rows = [], 0
        for f in files:
            column = pq.read_table(f, columns=[g.features[0].name]).column(0).combine_chunks()
            found.append(np.minimum(np.diff(column.offsets.to_numpy()), g.max_len))
            rows += len(found[-1])
            if rows >= n:
                break
        lengths = np.concatenate(found) if found else np.zeros(1, dtype=np.int64)
        out[g.name] = rng.choice(lengths, size=n) if lengths.size else lengths
    return Lengths(out, f"{sum(1 for _ in files)} files of {directory / 'train'}")


# -- the model on the meta device ----------------------------------------------------------------------


def meta_model(config: Config, schema: FeatureSchema):
    """The SparseArch (TorchRec backend, meta device) and the dense arch (meta), as the trainer builds them."""
    from hydra.utils import instantiate

    from gem.sparse.arch import SparseArch

    s = config.sparse
    sparse = SparseArch.from_config(schema, s.embedding_dim, s.init_scale, s.dims, "torchrec", device="meta")
    dims = {f: sparse.pooled_dim(f) for f in schema.id_feature_names}
    dims.update({g.name: sparse.sequence_dim(g.name) for g in schema.sequence_groups})
    try:
        with torch.device("meta"):
            dense = instantiate(config.model, _partial_=True, _convert_="all")(schema=schema, feature_dims=dims)
    except Exception as e:  # Hydra wraps constructor errors; name the config node
        raise ConfigError(f"model: could not build {config.model.get('_target_')}: {e}") from e
    return sparse, dense, dims


def dense_flops(dense: nn.Module, batch_size: int, lengths: Lengths) -> tuple[float, float, str]:
    """Forward + backward FLOPs of one rank's step and the forward's alone: the arch's own
    ``flops()`` (``capabilities.counts_flops``) on ``batch_size`` sampled lengths, else 6
    (forward: 2) x parameters x examples (each weight used once per example)."""
    from gem.models.capabilities import capabilities

    if capabilities(dense).counts_flops:
        count = dense.flops
        sample = {
            g: torch.from_numpy(v[:batch_size] if v.size >= batch_size else np.resize(v, batch_size))
            for g, v in lengths.sample.items()
        }
        f = count(batch_size, sample)
        return (
            float(f["forward"] + f["backward"]),
            float(f["forward"]),
            f"{type(dense).__name__}.flops() on sampled lengths",
        )
    params = sum(p.numel() for p in dense.parameters())
    return (
        6.0 * params * batch_size,
        2.0 * params * batch_size,
        "6 x dense parameters x examples (the arch has no flops())",
    )


# -- activation probe ------------------------------------------------------------------------------


def probe_activations(
    config: Config, schema: FeatureSchema, lengths: Lengths, examples: int = PROBE_EXAMPLES
) -> Activations:
    """One forward of ``examples`` examples at the mean history length, on the CPU, counting the
    tensors autograd saves (module docstring). The tables are capped at PROBE_CARDINALITY rows."""
    from torch.utils._pytree import tree_leaves

    from gem.distributed.parallelize import dense_blocks
    from gem.models import sequence
    from gem.models.gem import GEMModel
    from gem.sparse.arch import SparseArch

    capped = schema.to_config()
    for f in capped["id_features"] + [f for g in capped["sequence_groups"] for f in g["features"]]:
        f["cardinality"] = min(f["cardinality"], PROBE_CARDINALITY)
    small = FeatureSchema.from_config(capped)
    s = config.sparse
    sparse = SparseArch.from_config(small, s.embedding_dim, s.init_scale, s.dims, "native", device="cpu")
    sparse.init_weights()
    _, dense, _ = meta_model(config, small)
    dense.to_empty(device="cpu")
    dense.init_weights()
    model = GEMModel(sparse, dense).train()
    probe_len = {g.name: int(round(lengths.mean(g.name))) for g in small.sequence_groups}
    batch = _probe_batch(small, examples, probe_len)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    blocks = dense_blocks(dense)
    saved = [0.0] * (len(blocks) + 1)  # the last: outside every block
    inputs = [0.0] * len(blocks)
    seen: set[int] = set()
    kept: list[torch.Tensor] = []  # alive until the end, so that no other tensor reuses a counted address
    current = [len(blocks)]

    def count(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen or t.device.type == "meta":
            return
        seen.add(ptr)
        kept.append(t)
        saved[current[0]] += storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    def pre_hook(index):
        def hook(module, args, kwargs):
            current[0] = index
            done = set()
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in done:
                    done.add(t.untyped_storage().data_ptr())
                    kept.append(t)
                    inputs[index] += t.untyped_storage().nbytes()

        return hook

    def post_hook(module, args, output):
        current[0] = len(blocks)

    real = sequence.jagged_attention

    def attention(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, **kwargs):
        """The reference computes the output (untracked); count what the Triton kernel saves."""
        with torch.no_grad():
            o = real(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, **kwargs)
        for t in (q, k, v, o):
            count(t)
        if kwargs.get("activation", "softmax") == "softmax":
            saved[current[0]] += 4 * o.numel() // o.shape[-1]  # the log-sum-exp per row and head (fp32)
        return o.requires_grad_()

    handles = [b.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(post_hook) for b in blocks]
    sequence.jagged_attention = attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch)
    finally:
        sequence.jagged_attention = real
        for h in handles:
            h.remove()
    return Activations(
        [b / examples for b in saved[:-1]], [i / examples for i in inputs], saved[-1] / examples, probe_len
    )


def _probe_batch(schema: FeatureSchema, n: int, lengths: dict[str, int]):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gem.data.pipeline.batch import Batch

    gen = torch.Generator().manual_seed(0)

    def kjt(features: list[tuple[str, int, int]]) -> KeyedJaggedTensor:  # (name, cardinality, per-example length)
        keys = [f for f, _, _ in features]
        lens = torch.tensor([length for _, _, length in features for _ in range(n)], dtype=torch.int64)
        values = torch.cat(
            [torch.randint(0, card, (n * length,), generator=gen) for _, card, length in features]
            or [torch.zeros(0, dtype=torch.int64)]
        )
        return KeyedJaggedTensor.from_lengths_sync(keys, values, lens)

    sparse = kjt([(f.name, f.cardinality, f.max_ids) for f in schema.id_features])
    sequences = kjt([(f.name, f.cardinality, lengths[g.name]) for g in schema.sequence_groups for f in g.features])
    return Batch(
        sparse=sparse,
        sequences=sequences,
        max_seq_len=dict(lengths),
        dense=torch.zeros(n, schema.num_dense),
        labels=torch.zeros(n, schema.num_tasks),
        label_mask=torch.ones(n, schema.num_tasks, dtype=torch.bool),
        domain=torch.zeros(n, dtype=torch.int64),
    )


# -- memory ----------------------------------------------------------------------------------------------


# TorchRec's compute kernels that keep a table's rows in host memory (UVM): all of them there, or (the
# caching ones) there with a cache of a share of them in HBM.
UVM_KERNELS = ("fused_uvm", "fused_uvm_caching")


def uvm_cache_share(kernel: str) -> float:
    """The share of a table shard (weights and optimizer state) in HBM under ``kernel``: 1 for HBM
    kernels, 0 for ``fused_uvm``, TorchRec's planner's cache load factor for ``fused_uvm_caching``
    (the storage it planned; gem's sharders set no other)."""
    from torchrec.distributed.planner.constants import UVM_CACHING_RATIO

    return {"fused_uvm": 0.0, "fused_uvm_caching": UVM_CACHING_RATIO}.get(kernel, 1.0)


def table_memory(sharding: dict, world_size: int, optimizer: str) -> dict[str, np.ndarray]:
    """Per rank, in device memory: table weights, their optimizer state, (data-parallel tables)
    gradients and the HBM caches of tables kept in host memory (:func:`host_table_memory`)."""
    state = SPARSE_STATE[optimizer]
    weights, opt, grads, cache = (np.zeros(world_size, dtype=np.int64) for _ in range(4))
    for t in sharding["tables"].values():
        if t["sharding_type"] == "data_parallel":
            weights += 4 * t["rows"] * t["dim"]
            opt += state(t["rows"], t["dim"])
            grads += 4 * t["rows"] * t["dim"]
            continue
        share = uvm_cache_share(str(t.get("compute_kernel")))
        for shard in t["shards"]:
            rows, cols = shard["sizes"]
            if share == 1.0:
                weights[shard["rank"]] += 4 * rows * cols
                opt[shard["rank"]] += state(rows, cols)
            else:
                cache[shard["rank"]] += round(share * (4 * rows * cols + state(rows, cols)))
    out = {"tables": weights, "table optimizer": opt, "data-parallel table grads": grads}
    if cache.any():
        out["UVM table caches"] = cache
    return out


def host_table_memory(sharding: dict, world_size: int, optimizer: str) -> dict[str, np.ndarray]:
    """Per rank, in host memory: the weights and optimizer state of the shards TorchRec's planner
    put in UVM (``fused_uvm`` / ``fused_uvm_caching``); empty when there are none."""
    state = SPARSE_STATE[optimizer]
    weights, opt = np.zeros(world_size, dtype=np.int64), np.zeros(world_size, dtype=np.int64)
    for t in sharding["tables"].values():
        if str(t.get("compute_kernel")) not in UVM_KERNELS:
            continue
        for shard in t["shards"]:
            rows, cols = shard["sizes"]
            weights[shard["rank"]] += 4 * rows * cols
            opt[shard["rank"]] += state(rows, cols)
    if not weights.any():
        return {}
    return {"UVM tables": weights, "UVM table optimizer": opt}


def embedding_io_bytes(schema: FeatureSchema, sparse, batch_size: int, lengths: Lengths) -> float:
    pooled = sum(sparse.pooled_dim(f) for f in schema.id_feature_names)
    tokens = sum(batch_size * lengths.mean(g.name) * sparse.sequence_dim(g.name) for g in schema.sequence_groups)
    return 2 * 4 * (batch_size * pooled + tokens)


def dense_memory(config: Config, params: int, block_params: list[int], dims, fsdp: bool) -> dict[str, float]:
    """Dense parameters, gradients, AdamW state (fp32, sharded over dp_shard) and the gathered blocks."""
    p = config.parallelism
    shard = dims.dp_shard if fsdp else 1
    compute = DTYPE_BYTES[p.param_dtype] if fsdp else 4
    largest = max(block_params, default=0)
    root = params - sum(block_params)
    if not fsdp:
        gathered = 0.0
    elif p.reshard_after_forward:
        gathered = compute * (2 * largest + root) + 4 * largest  # two blocks (one prefetched) + their grads
    else:
        gathered = compute * params + 4 * largest
    if fsdp and shard == 1 and compute == 4:
        gathered = 4 * largest  # one copy: the unsharded parameters are the fp32 ones
    return {
        "dense params": 4 * params / shard,
        "dense grads": 4 * params / shard,
        "dense optimizer (AdamW)": 8 * params / shard,
        "gathered dense blocks": gathered,
    }


# -- the plan ----------------------------------------------------------------------------------------------


def make_plan(config: Config, probe: tuple[Activations | None, str] | None = None) -> Plan:
    """Plan ``config`` (a validated gem.train.config.Config) for ``plan.world_size`` ranks.

    With ``sparse.sharding_group_size=G`` (2-D sparse parallelism, TorchRec's DMPCollection) the
    tables are planned for a group of ``G`` ranks, as training shards them; the group of global
    rank ``r`` is ``r mod (W / G)`` and its rank in the group ``r // (W / G)`` (DMPCollection's
    strided groups: the replicas of a shard are ``W / G`` consecutive ranks). ``probe``: the
    activations (and note) of an earlier plan of the same model and batch, not measured again."""
    from gem.distributed.parallel_dims import ParallelDims, ParallelLayoutError
    from gem.distributed.parallelize import dense_blocks
    from gem.distributed.sharding import (
        explicit_plan,
        fuse_optimizer,
        load_plan_file,
        plan_to_dict,
        planner_plan,
        sharders,
    )

    p, s = config.plan, config.sparse
    world = p.world_size
    local = min(p.gpus_per_node, world)
    try:
        dims = ParallelDims(config.parallelism.dp_replicate, config.parallelism.dp_shard, world, local)
    except ParallelLayoutError as e:
        raise ConfigError(f"{e} (plan.world_size={world})") from None
    fsdp = config.parallelism.fully_shard if config.parallelism.fully_shard is not None else world > 1
    group = s.sharding_group_size
    if group is not None and (group < 1 or world % group):
        raise ConfigError(
            f"sparse.sharding_group_size={group} does not divide plan.world_size={world}; set a "
            f"divisor (e.g. sparse.sharding_group_size="
            f"{max(d for d in range(1, max(group, 1) + 1) if world % d == 0)}) or null"
        )
    group = None if group == world else group
    plan_world = group or world
    plan_local = min(local, plan_world)  # as gem.distributed.sharding.shard_sparse_arch plans a group
    schema, directory = plan_schema(config)
    lengths = history_lengths(config, schema, directory)
    sparse, dense, _ = meta_model(config, schema)
    params = sum(t.numel() for t in dense.parameters())
    block_params = [sum(t.numel() for t in b.parameters()) for b in dense_blocks(dense)]
    batch = config.data.batch_size
    flops, forward_flops, flops_source = dense_flops(dense, batch, lengths)
    warnings: list[str] = []

    activations, note = None, "not estimated (plan.activations=none)"
    compute_bytes = 2 if (fsdp and config.parallelism.param_dtype != "float32") or config.trainer.autocast else 4
    if probe is not None:
        activations, note = probe
    elif p.activations == "probe":
        try:
            activations = probe_activations(config, schema, lengths)
            note = (
                f"probe: {PROBE_EXAMPLES} examples at history length {activations.probe_length}, "
                f"x {batch} examples, x {compute_bytes}/4 for the compute dtype"
                + (", checkpointed" if config.parallelism.activation_checkpointing else "")
            )
        except Exception as e:  # a dense arch the probe cannot run: plan without, and say so
            note = f"not estimated: the probe failed ({type(e).__name__}: {e})"
            warnings.append(f"activations {note}; the totals below leave them out")
    act = 0.0
    if activations is not None:
        act = activations.per_example(config.parallelism.activation_checkpointing) * batch * compute_bytes / 4

    memory_dense = dense_memory(config, params, block_params, dims, fsdp)
    io = embedding_io_bytes(schema, sparse, batch, lengths) if world > 1 else 0.0  # one rank: no all-to-all
    rest = sum(memory_dense.values()) + act + io
    reserved = rest + p.reserve_gb * GiB
    if reserved >= p.hbm_gb * GiB:
        warnings.append(
            f"the dense part, activations and reserve alone take {_human(reserved)} of "
            f"plan.hbm_gb={p.hbm_gb:g}; the tables were planned as if they had the whole budget"
        )
        reserved = 0.0
    table_optim = config.optim.sparse  # the fused parameters training gives FBGEMM
    fuse_optimizer(sparse, table_optim.name, table_optim.lr, table_optim.eps, weight_decay=table_optim.weight_decay)
    from torchrec.distributed.planner.types import PlannerError

    try:
        if s.plan_file:  # an existing plan file: check it and report its memory
            plan = load_plan_file(s.plan_file, sparse, plan_world, plan_local, p.device)
        elif s.plan or s.sharding_type is not None:  # an explicit plan, as training would build it
            per_table = {t.name: s.plan.get(t.name, s.sharding_type) for t in sparse.tables}
            plan = explicit_plan(
                sparse, {k: v for k, v in per_table.items() if v is not None}, plan_world, plan_local, p.device
            )
        else:
            plan = planner_plan(
                sparse,
                sharders(),
                None,
                plan_world,
                plan_local,
                p.device,
                p.hbm_gb,
                s.constraints,
                batch_size=batch,
                reserved_bytes=int(reserved),
                intra_node_gbps=p.intra_node_gbps,
                inter_node_gbps=p.inter_node_gbps,
            )
    except ValueError as e:  # explicit plan / plan file errors name the sparse.* key
        raise ConfigError(str(e)) from None
    except PlannerError as e:
        total = sum(t.num_bytes for t in sparse.tables)
        raise ConfigError(
            f"TorchRec's planner found no placement of the tables ({_human(total)} of fp32 "
            f"weights) in the {_human(p.hbm_gb * GiB - reserved)} per rank the dense part "
            f"leaves of plan.hbm_gb={p.hbm_gb:g} on {plan_world} ranks"
            + (f" (sparse.sharding_group_size={group})" if group else "")
            + "; raise plan.world_size"
            + (" or sparse.sharding_group_size" if group else "")
            + ", lower "
            f"sparse.embedding_dim / sparse.dims, or shrink the dense part "
            f"(parallelism.activation_checkpointing=true, data.batch_size) "
            f"[{type(e).__name__}: {str(e).splitlines()[0][:200]}]"
        ) from None
    sharding = plan_to_dict(plan, sparse, plan_world, plan_local, p.device)
    for name, t in sharding["tables"].items():
        empty = sum(1 for shard in t["shards"] if shard["sizes"][0] == 0)
        if empty and p.device == "cpu":  # measured with fbgemm-gpu-cpu 1.8 (gem/distributed/sharding.py)
            warnings.append(
                f"{name}: {empty} ranks hold empty row-wise shards ({t['rows']:,} rows over "
                f"{len(t['shards'])} ranks), on which FBGEMM's CPU row-wise Adagrad fails now and then; "
                f"fix: +sparse.constraints.{name}=[table_wise,data_parallel]"
            )
    memory = table_memory(sharding, plan_world, config.optim.sparse.name)
    host = host_table_memory(sharding, plan_world, config.optim.sparse.name)
    if group:  # global rank r holds the shards of group rank r // (W / G)
        memory = {k: np.repeat(v, world // group) for k, v in memory.items()}
        host = {k: np.repeat(v, world // group) for k, v in host.items()}
        if p.device != "cuda":
            warnings.append(
                "sparse.sharding_group_size: TorchRec's DMPCollection runs on CUDA only; training on CPU refuses it"
            )
    memory["embedding I/O"] = np.full(world, io)
    for k, v in memory_dense.items():
        memory[k] = np.full(world, v)
    memory["activations"] = np.full(world, act)
    result = Plan(
        config,
        world,
        local,
        schema,
        sharding,
        lengths,
        params,
        block_params,
        dims,
        fsdp,
        memory,
        flops,
        flops_source,
        activations,
        note,
        warnings,
        forward_flops=forward_flops,
        group_size=group,
        host_memory=host,
    )
    warnings += budget_warnings(result)
    return result


def budget_warnings(plan: Plan) -> list[str]:
    """A warning per kind of overflow, naming the ranks, the largest parts and the fix."""
    out = []
    total = plan.total()
    over = np.flatnonzero(total > plan.budget)
    if not over.size:
        return out
    c, p = plan.config, plan.config.plan
    worst = int(total.argmax())
    parts = sorted(((k, float(v[worst])) for k, v in plan.memory.items()), key=lambda kv: -kv[1])
    head = (
        f"{len(over)} of {plan.world_size} ranks need more than the {_human(plan.budget)} budget "
        f"(plan.hbm_gb={p.hbm_gb:g} less plan.reserve_gb={p.reserve_gb:g}); rank {worst}: "
        f"{_human(total[worst])}, mostly " + ", ".join(f"{k} {_human(v)}" for k, v in parts[:3])
    )
    fixes = []
    biggest = parts[0][0]
    if biggest == "activations" and plan.activations is not None:
        if not c.parallelism.activation_checkpointing:
            ac = plan.activations.per_example(True) / plan.activations.per_example(False)
            fixes.append(
                f"parallelism.activation_checkpointing=true (activations x{ac:.2f}: "
                f"{_human(plan.memory['activations'][worst] * ac)})"
            )
        scaled = plan.memory["activations"][worst] + plan.memory["embedding I/O"][worst]  # both grow with the batch
        per_example = scaled / c.data.batch_size
        room = plan.budget - (total[worst] - scaled)
        if room > 0:
            fixes.append(f"data.batch_size={max(1, int(room // per_example))} (the largest that fits)")
    if biggest.startswith("dense") or biggest == "gathered dense blocks":
        if not plan.fsdp or plan.dims.dp_shard < min(plan.world_size, p.gpus_per_node):
            fixes.append("shard the dense arch over the node: parallelism=hsdp (or parallelism=fsdp)")
        if not c.parallelism.reshard_after_forward:
            fixes.append("parallelism.reshard_after_forward=true (two gathered blocks at a time, not all)")
        fixes.append("a larger parallelism.dp_shard")
    if biggest.startswith("table") or biggest == "data-parallel table grads":
        if c.optim.sparse.name != "rowwise_adagrad":
            fixes.append("optim.sparse.name=rowwise_adagrad (one float of state per row, not per weight)")
        heavy = sorted(plan.sharding["tables"].items(), key=lambda kv: -kv[1]["rows"] * kv[1]["dim"])[0][0]
        if plan.group_size:
            fixes.append(
                f"a larger sparse.sharding_group_size (now {plan.group_size}: each rank holds 1/"
                f"{plan.group_size} of the tables)"
            )
        fixes.append(
            f"more ranks (plan.world_size), a smaller sparse.embedding_dim / sparse.dims, or spreading "
            f"the largest table: +sparse.constraints.{heavy}=[row_wise]"
        )
    if biggest == "embedding I/O":
        fixes.append("a smaller data.batch_size or shorter histories (data.schema max_len)")
    out.append(head + "; fix: " + "; or ".join(fixes) if fixes else head)
    return out


# -- the report ----------------------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    ranks = sorted(ranks)
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def rank_groups(sharding: dict, world_size: int) -> list[tuple[list[int], list[str]]]:
    """Ranks that hold the same kinds of shards, with what they hold (``table rows x cols sharding``)."""
    held: list[list[str]] = [[] for _ in range(world_size)]
    for name, t in sharding["tables"].items():
        if t["sharding_type"] == "data_parallel":
            for r in range(world_size):
                held[r].append(f"{name} {t['rows']}x{t['dim']} data_parallel")
            continue
        for shard in t["shards"]:
            rows, cols = shard["sizes"]
            held[shard["rank"]].append(f"{name} {rows}x{cols} {t['sharding_type']}")
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, items in enumerate(held):
        groups.setdefault(tuple(items), []).append(r)
    return sorted(((ranks, list(items)) for items, ranks in groups.items()), key=lambda g: g[0][0])


def format_report(plan: Plan) -> str:
    c, p = plan.config, plan.config.plan
    w, b = plan.world_size, c.data.batch_size
    nodes = math.ceil(w / plan.local_size)
    lines = [
        f"plan for {w} ranks ({nodes} node{'s' * (nodes > 1)} of {plan.local_size} {p.device} devices, "
        f"{p.hbm_gb:g} GiB each), model {c.model.get('_target_')}"
        + (f" block={c.model.get('block')}" if c.model.get("block") else ""),
        f"batch {b} per rank, {b * w:,} global; histories ({plan.lengths.source}): "
        + ", ".join(f"{g} mean {plan.lengths.mean(g):.1f}" for g in plan.lengths.sample),
        f"dense arch: {plan.dense_params / 1e6:.2f}M parameters in {len(plan.block_params)} blocks, "
        f"{plan.dims.describe() if plan.fsdp else 'not sharded'}; "
        + (
            f"{_flops(plan.flops_per_step)} per rank per step ({plan.flops_source})"
            if plan.flops_per_step
            else "FLOPs unknown"
        ),
    ]
    n = plan.sharding_world
    if plan.group_size:
        step = w // n
        lines.append(
            f"2-D sparse parallelism (sparse.sharding_group_size={n}, TorchRec DMPCollection): tables "
            f"sharded inside {step} groups of {n} ranks (group i: ranks i, i+{step}, i+{2 * step}, ...), "
            f"replicated across them (each shard's {step} replicas on consecutive ranks); ranks below are "
            f"ranks in a group"
        )
    lines += [
        "",
        "tables ("
        + (
            "plan file " + c.sparse.plan_file
            if c.sparse.plan_file
            else "explicit: sparse.plan / sparse.sharding_type"
            if c.sparse.plan or c.sparse.sharding_type
            else "TorchRec planner"
        )
        + "):",
    ]
    rows = [["table", "rows", "dim", "sharding", "shards", "ranks", "fp32 weights"]]
    for name, t in plan.sharding["tables"].items():
        ranks = t["ranks"] or list(range(n))
        rows.append(
            [
                name,
                f"{t['rows']:,}",
                str(t["dim"]),
                t["sharding_type"],
                str(max(1, len(t["shards"]))),
                _ranks(ranks),
                _human(4 * t["rows"] * t["dim"]),
            ]
        )
    lines += _table(rows, right=(1, 2, 4, 6))
    lines += ["", "shards per rank" + (" of a group:" if plan.group_size else ":")]
    for ranks, items in rank_groups(plan.sharding, n):
        lines.append(
            f"  {'group ' if plan.group_size else ''}rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: "
            + ("; ".join(items) or "no tables")
        )
    lines += [
        "",
        f"memory per rank (budget {_human(plan.budget)} = plan.hbm_gb {p.hbm_gb:g} - plan.reserve_gb "
        f"{p.reserve_gb:g}):",
    ]
    rows = [["part", "min", "max", "max at rank"]]
    for k, v in list(plan.memory.items()) + [("total", plan.total())]:
        rows.append([k, _human(v.min()), _human(v.max()), str(int(v.argmax())) if v.max() > v.min() else "all"])
    lines += _table(rows, right=(1, 2, 3))
    lines.append(f"activations: {plan.activation_note}")
    if plan.host_memory:
        uvm = [n for n, t in plan.sharding["tables"].items() if str(t.get("compute_kernel")) in UVM_KERNELS]
        lines += [
            "",
            f"host memory per rank (TorchRec's planner put {', '.join(uvm)} in UVM; not in the budget above, "
            f"which holds their HBM caches):",
        ]
        rows = [["part", "min", "max", "max at rank"]]
        host_total = sum(plan.host_memory.values())
        for k, v in list(plan.host_memory.items()) + [("total", host_total)]:
            rows.append([k, _human(v.min()), _human(v.max()), str(int(v.argmax())) if v.max() > v.min() else "all"])
        lines += _table(rows, right=(1, 2, 3))
    if plan.step_time is not None:
        lines += ["", *plan.step_time.text().splitlines()]
    if plan.groups is not None:
        lines += ["", *plan.groups.text().splitlines()]
    lines.append("")
    if plan.warnings:
        lines += [f"WARNING: {m}" for m in plan.warnings]
    else:
        lines.append(f"every rank fits: largest {_human(plan.total().max())} of {_human(plan.budget)}")
    return "\n".join(lines)


def _table(rows: list[list[str]], right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def fmt(r):
        return (
            "  "
            + "  ".join(c.rjust(wd) if i in right else c.ljust(wd) for i, (c, wd) in enumerate(zip(r, widths))).rstrip()
        )

    return [fmt(rows[0]), fmt(["-" * wd for wd in widths])] + [fmt(r) for r in rows[1:]]
