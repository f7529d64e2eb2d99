"""TorchRec sharding of the SparseArch: the plan (explicit per table, or TorchRec's planner), fused
optimizer applied in backward, DistributedModelParallel (or DMPCollection for 2-D sparse parallelism).

An explicit plan names a sharding for each table (``sparse.plan`` / ``sparse.sharding_type``)::

    t_user_id: table_wise      # the whole table on one rank (round robin, or table_wise:<rank>)
    t_ad_id: row_wise          # rows split evenly over all ranks
    t_hist_item: column_wise   # columns split over all ranks
    t_ad_cluster: table_row_wise  # rows split over the ranks of one node (table_row_wise:<node>)
    t_hist_gap: data_parallel  # a full copy on every rank, gradients all-reduced

Explicit plans work on any device; TorchRec's planner (no plan given) chooses from the cost model,
the per-rank HBM budget and per-table constraints, and is the choice on GPU clusters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gem.sparse.arch import fbgemm_has_kernels

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
EXPLICIT_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
_MODULES = ("ebc", "ec")  # SparseArch's EmbeddingBagCollection and EmbeddingCollection
logger = logging.getLogger("gem")


def _optimizer(name: str):
    """The in-backward optimizer class TorchRec maps onto FBGEMM's fused kernel of the same rule."""
    if name == "rowwise_adagrad":
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        return RowWiseAdagrad
    if name == "adagrad":
        return torch.optim.Adagrad
    raise ValueError(f"optim.sparse.name={name!r} is not one of ['rowwise_adagrad', 'adagrad']")


def _table_sharding(spec: str, table: str, index: int, world_size: int, local_size: int):
    """``"table_wise[:rank]" | "row_wise" | "column_wise" | "table_row_wise[:node]" | "data_parallel"``
    -> TorchRec's ParameterShardingGenerator."""
    from torchrec.distributed import sharding_plan as sp

    kind, _, arg = spec.partition(":")
    if kind not in EXPLICIT_TYPES:
        raise ValueError(
            f"sparse.plan.{table}={spec!r}: the sharding must be one of {list(EXPLICIT_TYPES)} "
            f"(table_wise:<rank> and table_row_wise:<node> pin the placement)"
        )
    if arg and kind not in ("table_wise", "table_row_wise"):
        raise ValueError(f"sparse.plan.{table}={spec!r}: only table_wise and table_row_wise take a ':<index>'")
    if kind == "table_wise":
        rank = int(arg) if arg else index % world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"sparse.plan.{table}={spec!r}: rank {rank} is outside [0, {world_size})")
        return sp.table_wise(rank=rank)
    if kind == "table_row_wise":
        host = int(arg) if arg else index % max(1, world_size // local_size)
        if not 0 <= host < world_size // local_size:
            raise ValueError(f"sparse.plan.{table}={spec!r}: node {host} is outside [0, {world_size // local_size})")
        return sp.table_row_wise(host_index=host)
    if kind == "column_wise":
        return sp.column_wise(ranks=list(range(world_size)))
    return sp.row_wise() if kind == "row_wise" else sp.data_parallel()


def explicit_plan(
    sparse_arch: nn.Module, per_table: Mapping[str, str], world_size: int, local_size: int, device_type: str
):
    """A TorchRec ShardingPlan from one sharding string per table (every table must be named)."""
    from torchrec.distributed.planner.types import ShardingPlan
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    names = [t.name for t in sparse_arch.tables]
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise ValueError(f"sparse.plan: unknown table(s) {unknown}; the tables are {names}")
    missing = [n for n in names if n not in per_table]
    if missing:
        raise ValueError(
            f"sparse.plan: no sharding for table(s) {missing}; name them in sparse.plan or set "
            f"sparse.sharding_type for every table"
        )
    for t in sparse_arch.tables:
        if not t.pooled and per_table[t.name].startswith("table_row_wise"):
            raise ValueError(
                f"sparse.plan.{t.name}=table_row_wise: TorchRec shards sequence tables "
                f"(EmbeddingCollection) table_wise, row_wise, column_wise or data_parallel only; "
                f"name another sharding for {t.name} in sparse.plan"
            )
        spec = per_table[t.name]
        over = world_size if spec == "row_wise" else local_size if spec.startswith("table_row_wise") else 0
        if t.num_embeddings < over:
            # Measured with fbgemm-gpu-cpu 1.8: the row-wise Adagrad of an empty shard fails now and then.
            raise ValueError(
                f"sparse.plan.{t.name}={spec}: {t.num_embeddings} rows over {over} ranks leaves ranks "
                f"without rows; name table_wise or data_parallel for {t.name} in sparse.plan"
            )
        if not t.pooled and per_table[t.name] == "data_parallel" and device_type == "cpu":
            # Measured with TorchRec 1.8 / fbgemm-gpu-cpu 1.8: the lookup returns one row per example
            # instead of one per event, and the forward fails in construct_jagged_tensors.
            raise ValueError(
                f"sparse.plan.{t.name}=data_parallel: TorchRec's data-parallel EmbeddingCollection "
                f"fails on CPU; name another sharding for sequence table {t.name} in sparse.plan"
            )
    plan = {}
    for attr in _MODULES:
        module = getattr(sparse_arch, attr)
        tables = [t for t in sparse_arch.tables if t.pooled == (attr == "ebc")]
        if not tables:
            continue
        generators = {
            t.name: _table_sharding(per_table[t.name], t.name, names.index(t.name), world_size, local_size)
            for t in tables
        }
        plan[attr] = construct_module_sharding_plan(
            module, generators, local_size=local_size, world_size=world_size, device_type=device_type
        )
    return ShardingPlan(plan)


def sharders() -> list:
    """The TorchRec sharders of SparseArch's two collections (pooled bags, per-event rows)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def fuse_optimizer(
    sparse_arch: nn.Module,
    optimizer: str,
    lr: float,
    eps: float,
    frozen_tables: Sequence[str] = (),
    weight_decay: float = 0.0,
) -> None:
    """Attach the in-backward optimizer to the tables (before planning: TorchRec's planner sizes the
    optimizer state from it, and the sharded tables fuse it into FBGEMM's backward).

    The arguments become FBGEMM's fused parameters. ``weight_decay`` (``optim.sparse.weight_decay``,
    row-wise Adagrad only) goes with FBGEMM's L2 mode: ``g += weight_decay * w`` on each looked-up
    row before the row-wise Adagrad step, the rule of gem.train.optim.TouchedRowsAdagrad; 0 leaves
    the arguments as they were.

    ``frozen_tables`` (checkpoint.init_frozen) get learning rate 0 and no decay: other optimizer
    arguments put them in an FBGEMM kernel group of their own, so their weights stay bit-identical."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    kwargs = {"lr": lr, "eps": eps}
    if weight_decay:
        if optimizer != "rowwise_adagrad":
            raise ValueError(
                f"optim.sparse.weight_decay={weight_decay} needs optim.sparse.name=rowwise_adagrad, "
                f"not {optimizer!r}; set optim.sparse.weight_decay=0 or optim.sparse.name=rowwise_adagrad"
            )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kwargs.update(weight_decay=weight_decay, weight_decay_mode=WeightDecayMode.L2)
    frozen = {id(sparse_arch.table_weight(t)) for t in frozen_tables}
    params = list(sparse_arch.parameters())
    apply_optimizer_in_backward(_optimizer(optimizer), [p for p in params if id(p) not in frozen], kwargs)
    if frozen:
        apply_optimizer_in_backward(
            _optimizer(optimizer), [p for p in params if id(p) in frozen], {"lr": 0.0, "eps": eps}
        )


def check_weight_decay(plan, device_type: str, weight_decay: float) -> None:
    """Refuse ``optim.sparse.weight_decay`` where FBGEMM drops it without a word: pooled tables in its
    CPU kernels. Measured with fbgemm-gpu-cpu 1.8: after one step the pooled tables' rows were
    bit-identical with and without the decay, the sequence tables' rows as the formula says (FBGEMM's
    CPU backward for pooled float32 tables calls its fast row-wise Adagrad with a weight decay of 0).
    Data-parallel tables are stepped by gem.train.optim.TouchedRowsAdagrad, which decays."""
    if not weight_decay or device_type != "cpu":
        return
    pooled = [name for name, ps in (plan.plan.get("ebc") or {}).items() if ps.sharding_type != "data_parallel"]
    if pooled:
        raise ValueError(
            f"optim.sparse.weight_decay={weight_decay}: FBGEMM's CPU kernel for pooled tables drops the "
            f"decay silently (fbgemm-gpu-cpu 1.8), and pooled table(s) {sorted(pooled)} are sharded on "
            f"CPU; run on CUDA, make them data_parallel (sparse.plan.<table>=data_parallel, stepped by "
            f"gem's own row-wise Adagrad), set sparse.shard=false or sparse=native, or set "
            f"optim.sparse.weight_decay=0"
        )


def planner_plan(
    sparse_arch: nn.Module,
    sharders: Sequence,
    pg: dist.ProcessGroup | None,
    world_size: int,
    local_size: int,
    device_type: str,
    hbm_gb: float | None,
    constraints: Mapping[str, Sequence[str]] | None,
    *,
    batch_size: int | None = None,
    reserved_bytes: int | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
):
    """TorchRec's planner: enumerates shardings allowed by ``constraints`` (table -> sharding types),
    fits them in ``hbm_gb`` per rank, picks the cheapest by its cost model.

    With ``pg``, rank 0 plans and every rank receives its plan (training); without, this process
    plans for ``world_size`` ranks on its own (``python -m gem.plan``: no process group, a meta
    SparseArch). ``reserved_bytes`` per rank are kept out of the tables' budget (the dense part
    and activations); None keeps TorchRec's default reservation (15% plus its own estimate).
    ``batch_size`` (per rank) and the bandwidths (GB/s) feed the planner's cost model.
    """
    import warnings

    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = [t.name for t in sparse_arch.tables]
    for table, types in (constraints or {}).items():
        if table not in names:
            raise ValueError(f"sparse.constraints.{table}: unknown table; the tables are {names}")
        bad = [s for s in types if s not in SHARDING_TYPES]
        if bad:
            raise ValueError(f"sparse.constraints.{table}: {bad} not in {list(SHARDING_TYPES)}")
    bandwidths = {}
    for key, gbps in (("intra_host_bw", intra_node_gbps), ("inter_host_bw", inter_node_gbps)):
        if gbps:
            bandwidths[key] = gbps * 1e9 / 1000  # TorchRec's unit: bytes per ms
    topology = Topology(
        world_size=world_size,
        local_world_size=local_size,
        compute_device=device_type,
        hbm_cap=int(hbm_gb * 1024**3) if hbm_gb else None,
        **bandwidths,
    )
    extra = {}
    if reserved_bytes is not None:
        from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

        with warnings.catch_warnings():  # its FutureWarning is about the estimate passed here
            warnings.simplefilter("ignore", FutureWarning)
            extra["storage_reservation"] = HeuristicalStorageReservation(
                percentage=0.0, dense_tensor_estimate=int(reserved_bytes)
            )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        debug=pg is not None,  # its stats table: in training logs only
        constraints={t: ParameterConstraints(sharding_types=list(s)) for t, s in (constraints or {}).items()} or None,
        **extra,
    )
    if pg is None:
        return planner.plan(sparse_arch, list(sharders))
    return planner.collective_plan(sparse_arch, list(sharders), pg)


# -- plan files: a plan made by `python -m gem.plan` (or saved by a run), loaded with sparse.plan_file ----------

PLAN_FORMAT = "gem.sharding_plan"
PLAN_VERSION = 1


def plan_to_dict(plan, sparse_arch: nn.Module, world_size: int, local_size: int, device_type: str) -> dict:
    """A TorchRec ShardingPlan as plain JSON data: per table its module, shape, sharding type,
    compute kernel, ranks and shards (offsets, sizes, rank); device-neutral placements."""
    specs = {t.name: t for t in sparse_arch.tables}
    tables = {}
    for attr in _MODULES:
        for name, ps in (plan.plan.get(attr) or {}).items():
            shards = [
                {"offsets": list(m.shard_offsets), "sizes": list(m.shard_sizes), "rank": m.placement.rank()}
                for m in (ps.sharding_spec.shards if ps.sharding_spec is not None else [])
            ]
            tables[name] = {
                "module": attr,
                "rows": specs[name].num_embeddings,
                "dim": specs[name].embedding_dim,
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "ranks": list(ps.ranks) if ps.ranks is not None else None,
                "shards": shards,
            }
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "world_size": world_size,
        "local_world_size": local_size,
        "device": device_type,
        "tables": tables,
    }


def plan_from_dict(
    data: Mapping,
    sparse_arch: nn.Module,
    world_size: int,
    local_size: int,
    device_type: str,
    where: str = "sparse.plan_file",
):
    """The ShardingPlan of :func:`plan_to_dict`'s data, checked against this run's tables and world."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.sharding_plan import placement
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    if data.get("format") != PLAN_FORMAT or data.get("version") != PLAN_VERSION:
        raise ValueError(
            f"{where}: not a gem sharding plan (format {data.get('format')!r} version "
            f"{data.get('version')!r}, expected {PLAN_FORMAT!r} {PLAN_VERSION}); write one with "
            f"python -m gem.plan"
        )
    if data["world_size"] != world_size:
        raise ValueError(
            f"{where}: the plan is for {data['world_size']} ranks, this run shards over {world_size}; "
            f"plan again with plan.world_size={world_size}, or launch {data['world_size']} ranks"
        )
    if data.get("local_world_size", local_size) != local_size:
        raise ValueError(
            f"{where}: the plan is for nodes of {data['local_world_size']} ranks, this run has "
            f"{local_size} per node; plan again with plan.gpus_per_node={local_size}"
        )
    specs = {t.name: t for t in sparse_arch.tables}
    tables = data["tables"]
    if set(tables) != set(specs):
        raise ValueError(
            f"{where}: the plan's tables {sorted(tables)} are not this model's {sorted(specs)}; plan "
            f"again with this run's data.schema and sparse.* settings"
        )
    for name, t in tables.items():
        spec = specs[name]
        if (t["rows"], t["dim"], t["module"]) != (
            spec.num_embeddings,
            spec.embedding_dim,
            "ebc" if spec.pooled else "ec",
        ):
            raise ValueError(
                f"{where}: table {name} is {t['rows']} x {t['dim']} in the plan, {spec.num_embeddings} x "
                f"{spec.embedding_dim} in this model; plan again with this run's data.schema and sparse.*"
            )
    if data.get("device") != device_type:
        logger.warning("%s was planned for %s devices, this run is on %s", where, data.get("device"), device_type)
    plan = {}
    for attr in _MODULES:
        module_plan = {}
        for name, t in tables.items():
            if t["module"] != attr:
                continue
            spec = None
            if t["shards"]:
                spec = EnumerableShardingSpec(
                    [
                        ShardMetadata(
                            shard_offsets=list(s["offsets"]),
                            shard_sizes=list(s["sizes"]),
                            placement=placement(device_type, s["rank"], local_size),
                        )
                        for s in t["shards"]
                    ]
                )
            module_plan[name] = ParameterSharding(
                sharding_type=t["sharding_type"],
                compute_kernel=t["compute_kernel"],
                ranks=t["ranks"],
                sharding_spec=spec,
            )
        if module_plan:
            plan[attr] = EmbeddingModuleShardingPlan(module_plan)
    return ShardingPlan(plan)


def load_plan_file(path: str, sparse_arch: nn.Module, world_size: int, local_size: int, device_type: str):
    """The ShardingPlan in a plan file (JSON, written by ``python -m gem.plan``; its ``sharding`` key)."""
    import json

    try:
        data = json.loads(open(path).read())
    except OSError as e:
        raise ValueError(
            f"sparse.plan_file={path!r} cannot be read ({e.strerror}); write it with python -m gem.plan plan.out={path}"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sparse.plan_file={path!r} is not JSON ({e})") from None
    return plan_from_dict(
        data.get("sharding", data), sparse_arch, world_size, local_size, device_type, f"sparse.plan_file={path!r}"
    )


def shard_sparse_arch(
    sparse_arch: nn.Module,
    device: torch.device,
    sparse_lr: float,
    sparse_eps: float,
    sharding_type: str | None = None,
    pg: dist.ProcessGroup | None = None,
    *,
    plan: Mapping[str, str] | None = None,
    hbm_gb: float | None = None,
    constraints: Mapping[str, Sequence[str]] | None = None,
    optimizer: str = "rowwise_adagrad",
    sharding_group_size: int | None = None,
    plan_file: str | None = None,
    frozen_tables: Sequence[str] = (),
    weight_decay: float = 0.0,
) -> nn.Module:
    """Shard ``sparse_arch``'s tables over the ranks of ``pg`` with TorchRec.

    Args:
        sharding_type / plan: explicit plan: ``plan`` (table -> sharding string), tables not in it
            take ``sharding_type``. Neither: TorchRec's planner with ``hbm_gb`` and ``constraints``.
        plan_file: a plan saved by ``python -m gem.plan`` (shard by shard, for this world size):
            the dry run's placement, instead of planning again.
        optimizer: the embedding optimizer, fused into the backward pass: after ``loss.backward()``
            the sharded tables are already updated, there is no separate step (data-parallel tables
            are stepped by gem.train.optim with the same rule).
        sharding_group_size: TorchRec's 2-D sparse parallelism (DMPCollection, CUDA only): tables
            are sharded inside groups of this many ranks and replicated across the groups.
        frozen_tables: tables trained with learning rate 0 (see :func:`fuse_optimizer`).
        weight_decay: L2 decay on the rows a step touches (``optim.sparse.weight_decay``, see
            :func:`fuse_optimizer`); refused for pooled tables sharded on CPU (:func:`check_weight_decay`).

    The plan is logged as a table (see :func:`format_plan`).
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    if device.type == "cuda" and not fbgemm_has_kernels("cuda"):
        raise ValueError(
            f"sparse=torchrec with sparse.shard=true on CUDA runs FBGEMM's CUDA kernels, but the "
            f"installed fbgemm-gpu has none ({_fbgemm_build()}); install the CUDA build "
            f"(pip install fbgemm-gpu; on a lent GPU: tools/fbgemm_gpu_parts.sh) or set sparse=native"
        )
    pg = pg or dist.group.WORLD
    world_size = dist.get_world_size(pg)
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if sharding_group_size:
        if device.type != "cuda":
            raise ValueError(
                "sparse.sharding_group_size (TorchRec's DMPCollection) runs on CUDA only; "
                "set sparse.sharding_group_size=null on CPU"
            )
        if world_size % sharding_group_size:
            raise ValueError(
                f"sparse.sharding_group_size={sharding_group_size} does not divide the world size {world_size}"
            )
        world_size = sharding_group_size
        local_size = min(local_size, world_size)
    if sharding_type is not None and sharding_type not in EXPLICIT_TYPES:
        raise ValueError(
            f"sparse.sharding_type={sharding_type!r}: explicit plans support {list(EXPLICIT_TYPES)}; "
            f"leave it null and use sparse.constraints to let the planner choose"
        )
    if plan_file and (plan or sharding_type is not None):
        raise ValueError(
            "sparse.plan_file and sparse.plan / sparse.sharding_type both give a plan; keep one "
            "(sparse.plan={} sparse.sharding_type=null to use the file)"
        )
    fuse_optimizer(sparse_arch, optimizer, sparse_lr, sparse_eps, frozen_tables, weight_decay)
    table_sharders = sharders()
    if plan_file:
        sharding_plan = load_plan_file(plan_file, sparse_arch, world_size, local_size, device.type)
        source = f"plan file {plan_file}"
    elif plan or sharding_type is not None:
        per_table = {t.name: (plan or {}).get(t.name, sharding_type) for t in sparse_arch.tables}
        per_table = {k: v for k, v in per_table.items() if v is not None}
        sharding_plan = explicit_plan(sparse_arch, per_table, world_size, local_size, device.type)
        source = "explicit"
    else:
        sharding_plan = planner_plan(
            sparse_arch, table_sharders, pg, world_size, local_size, device.type, hbm_gb, constraints
        )
        source = "TorchRec planner"
    check_weight_decay(sharding_plan, device.type, weight_decay)
    logger.info("sparse sharding plan (%s):\n%s", source, format_plan(sharding_plan, sparse_arch, world_size))
    if sharding_group_size:
        from torchrec.distributed.model_parallel import DMPCollection

        return DMPCollection(
            sparse_arch,
            device=device,
            plan=sharding_plan,
            world_size=dist.get_world_size(pg),
            sharding_group_size=sharding_group_size,
            global_pg=pg,
            sharders=table_sharders,
        )
    return DistributedModelParallel(
        sparse_arch, env=ShardingEnv.from_process_group(pg), device=device, plan=sharding_plan, sharders=table_sharders
    )


def plan_rows(plan, sparse_arch: nn.Module, world_size: int) -> list[dict]:
    """One row per table: name, rows, dim, sharding, ranks, bytes per rank (fp32 weights)."""
    specs = {t.name: t for t in sparse_arch.tables}
    rows = []
    for attr in _MODULES:
        for name, ps in (plan.plan.get(attr) or {}).items():
            t = specs[name]
            per_rank = dict.fromkeys(range(world_size), 0)
            if ps.sharding_type == "data_parallel":
                ranks = list(range(world_size))
                per_rank = dict.fromkeys(ranks, t.num_bytes)
            else:
                ranks = []
                for shard in ps.sharding_spec.shards:
                    r = shard.placement.rank()
                    ranks.append(r)
                    per_rank[r] += shard.shard_sizes[0] * shard.shard_sizes[1] * 4
            rows.append(
                {
                    "table": name,
                    "rows": t.num_embeddings,
                    "dim": t.embedding_dim,
                    "sharding": ps.sharding_type,
                    "ranks": sorted(set(ranks)),
                    "bytes_per_rank": per_rank,
                }
            )
    return rows


def format_plan(plan, sparse_arch: nn.Module, world_size: int) -> str:
    """The plan as a fixed-width text table, one line per table and a total line."""
    rows = plan_rows(plan, sparse_arch, world_size)
    header = ["table", "rows", "dim", "sharding", "ranks"] + [f"bytes r{r}" for r in range(world_size)]
    lines = [
        [r["table"], str(r["rows"]), str(r["dim"]), r["sharding"], ",".join(map(str, r["ranks"]))]
        + [_human(r["bytes_per_rank"][k]) for k in range(world_size)]
        for r in rows
    ]
    lines.append(
        ["total", "", "", "", ""] + [_human(sum(r["bytes_per_rank"][k] for r in rows)) for k in range(world_size)]
    )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def _human(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""


def _fbgemm_build() -> str:
    """The installed fbgemm-gpu build and version, as gem.versions reads them."""
    from gem.versions import FBGEMM_BUILDS, installed

    found = installed()
    return next((f"{name} {found[name]}" for name in FBGEMM_BUILDS if found[name]), "no fbgemm-gpu distribution found")
