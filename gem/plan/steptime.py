"""A step-time model: predicted examples/s and scaling efficiency of a plan for 1 .. 4096 GPUs.

One training step of one rank, every rank with ``B = data.batch_size`` examples, ``W`` ranks in
nodes of ``G``::

    step = dense compute + embedding traffic + sparse all-to-all + exposed FSDP collectives + overhead

- **dense compute**: the arch's forward + backward FLOPs on the sampled history lengths
  (``flops()``, gem/train/flops.py; with activation checkpointing the forward once more) over
  ``plan.peak_tflops x plan.mfu``.
- **embedding traffic**: each lookup reads a row in forward and, with the fused optimizer,
  reads the gradient and the row and writes the row back in backward: ``16 x dim`` bytes, over
  ``plan.hbm_gbps x plan.embedding_efficiency``, on the rank with the most lookups (a
  table-wise table serves the lookups of all ``W x B`` examples on one rank).
- **all-to-all**: the embeddings each rank sends to the ranks whose examples need them, forward
  and (their gradients) backward, plus the ids in: a pooled row-wise table sends partial sums for
  all ``W x B`` examples (a reduce-scatter), a table-wise one its table's outputs, a sequence table
  the rows its shard looked up. A share ``(G-1)/(W-1)`` of the bytes stays in the node
  (``plan.intra_node_gbps``), the rest crosses it (``plan.inter_node_gbps``), the two at once.
  Not overlapped (TorchRec's pipeline hides the input ids' all-to-all and the copy, not the
  embeddings'), plus ``plan.collective_latency_ms`` per collective.
- **FSDP / HSDP**: all-gathers of the compute-dtype parameters (two per block per step with
  ``reshard_after_forward``, one without), reduce-scatters of the gradients in ``reduce_dtype``,
  and across replicas an all-reduce of the shards; on GPUs bandwidth time hides behind the dense
  compute (on a CPU, ``plan.device=cpu``, it does not: gloo collectives block), but every
  all-gather waits ``plan.collective_latency_ms``: calibrated on two H200s, where FSDP's 34
  all-gathers per step added 26 ms that bandwidth does not explain.
- **data-parallel tables**: an all-reduce of their full gradient.
- **2-D sparse parallelism** (``sparse.sharding_group_size=n``, TorchRec's DMPCollection): the
  all-to-all spans a sharding group of ``n`` ranks (strided: ranks ``i, i + W/n, ...``, so
  ``G / (W/n)`` of them share a node), and the ``W/n`` replicas of each shard (consecutive ranks)
  all-reduce the gradients of the rows the group's examples looked up, every step, not overlapped
  (an approximation: DMPCollection's ``sync()`` averages weights and optimizer state instead).
  :func:`compare_group_sizes` plans the tables again for a few group sizes at ``plan.world_size``.

Other world sizes than the plan's keep each table's sharding type (row-wise over all ranks,
table-wise on one, column-wise over its shard count, table-row-wise over a node), with the
placement TorchRec's planner chose at ``plan.world_size``; the planner is not run again per size.
``calibrate()`` fits ``mfu``, ``embedding_efficiency`` and ``collective_latency_ms`` to the
measured H200 runs (benchmarks/results/e2e-h200*.json, scaling-h200*.json) and reports the
model's error on the runs it was not fitted to (benchmarks/plan_model.py); gem/plan/cpu_calibration.py
does the same for gloo runs on a CPU host (benchmarks/plan_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gem.plan.planner import DTYPE_BYTES, Plan


@dataclass
class Traffic:
    """Per-step quantities of one world size (bytes, counts), before any bandwidth."""

    world_size: int
    embedding_bytes: float  # HBM traffic of the busiest rank's lookups and updates
    a2a_intra: float  # bytes the busiest rank moves inside its node (sent or received, the larger)
    a2a_inter: float  # ... across nodes
    a2a_collectives: int
    dp_table_bytes: float  # all-reduce of data-parallel tables' gradients
    fsdp_gather_bytes: float
    fsdp_reduce_bytes: float
    fsdp_intra: bool  # the dense shard group is inside one node
    replica_bytes: float  # HSDP / replicate: all-reduce across replicas
    gathers: int  # blocking all-gathers per step
    dims: tuple[int, int]  # (dp_replicate, dp_shard)
    group: int = 0  # ranks the tables are sharded over (sparse.sharding_group_size, else the world)
    replica_table_bytes: float = 0.0  # 2-D: all-reduce of the looked-up rows' gradients across the replicas
    replica_intra: bool = True  # ... whose ranks are in one node


@dataclass
class Row:
    world_size: int
    parts_ms: dict[str, float]
    batch: int
    memory: float = 0.0  # bytes per GPU, roughly (the tables spread evenly): see memory_at
    fits: bool = True

    @property
    def step_ms(self) -> float:
        return sum(self.parts_ms.values())

    @property
    def examples_per_s(self) -> float:
        return self.world_size * self.batch / (self.step_ms / 1e3)


@dataclass
class StepTimeTable:
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def efficiency(self, row: Row) -> float:
        one = self.rows[0]
        return row.examples_per_s / (row.world_size / one.world_size * one.examples_per_s)

    def text(self) -> str:
        parts = list(self.rows[0].parts_ms)
        head = ["GPUs", "step ms", *[p + " ms" for p in parts], "examples/s", "efficiency", "GiB/GPU"]
        table = [head] + [
            [
                str(r.world_size),
                f"{r.step_ms:.1f}",
                *[f"{r.parts_ms[p]:.1f}" for p in parts],
                f"{r.examples_per_s:,.0f}",
                f"{self.efficiency(r):.1%}",
                f"{r.memory / 2**30:.1f}" + ("" if r.fits else " *"),
            ]
            for r in self.rows
        ]
        widths = [max(len(t[i]) for t in table) for i in range(len(head))]
        lines = [
            "predicted step time (gem/plan/steptime.py; efficiency = examples/s over GPUs x the smallest "
            "row's per GPU):"
        ]
        lines += [
            "  " + "  ".join(c.rjust(w) for c, w in zip(t, widths))
            for t in [table[0], ["-" * w for w in widths], *table[1:]]
        ]
        if not all(r.fits for r in self.rows):
            lines.append(
                "  * over the memory budget at that size (tables spread evenly; the step time assumes it fits)"
            )
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def to_json(self) -> dict:
        return {
            "rows": [
                {
                    "world_size": r.world_size,
                    "step_ms": r.step_ms,
                    "examples_per_s": r.examples_per_s,
                    "efficiency": self.efficiency(r),
                    "parts_ms": r.parts_ms,
                    "memory_bytes": r.memory,
                    "fits": r.fits,
                }
                for r in self.rows
            ],
            "notes": self.notes,
        }


def _lookups_per_example(plan: Plan) -> dict[str, float]:
    """Ids per example of every table (multi-hot width of pooled features, mean history of sequence ones)."""
    out: dict[str, float] = {}
    schema = plan.schema
    tables = {f: name for name, t in plan.sharding["tables"].items() for f in _features(plan, name)}
    for f in schema.id_features:
        out[tables[f.name]] = out.get(tables[f.name], 0.0) + f.max_ids
    for g in schema.sequence_groups:
        for f in g.features:
            out[tables[f.name]] = out.get(tables[f.name], 0.0) + plan.lengths.mean(g.name)
    return out


def _features(plan: Plan, table: str) -> list[str]:
    from gem.sparse.tables import build_tables

    if not hasattr(plan, "_table_features"):
        s = plan.config.sparse
        plan._table_features = {
            t.name: list(t.feature_names) for t in build_tables(plan.schema, s.embedding_dim, s.init_scale, s.dims)
        }
    return plan._table_features[table]


def _layout(plan: Plan, world: int) -> tuple[int, int] | None:
    """(dp_replicate, dp_shard) of the config's parallelism at ``world`` ranks, or None if it does not tile."""
    from gem.distributed.parallel_dims import ParallelDims, ParallelLayoutError

    p = plan.config.parallelism
    if not plan.fsdp and world > 1:
        return (world, 1)
    try:
        d = ParallelDims(p.dp_replicate, p.dp_shard, world, min(plan.config.plan.gpus_per_node, world))
    except ParallelLayoutError:
        return None
    return d.dp_replicate, d.dp_shard


def sharding_group(plan: Plan, world: int) -> int | None:
    """Ranks the tables are sharded over at ``world`` ranks: ``sparse.sharding_group_size`` (the world
    below it), else the world; None where the group size does not divide it."""
    group = plan.group_size
    if not group or world <= group:
        return world
    return group if world % group == 0 else None


def traffic(plan: Plan, world: int) -> Traffic | None:
    """The per-step bytes of ``plan`` at ``world`` ranks (module docstring). With 2-D sparse
    parallelism the all-to-all spans a sharding group of ``n`` ranks (DMPCollection's strided
    groups: ``g / (world / n)`` of them share a node), and the replicas of each shard (``world / n``
    consecutive ranks) all-reduce the gradients of the rows the group's examples looked up."""
    c, cp = plan.config, plan.config.plan
    layout = _layout(plan, world)
    n = sharding_group(plan, world)
    if layout is None or n is None:
        return None
    b = c.data.batch_size
    g = min(cp.gpus_per_node, world)
    step = world // n  # replicas of each shard
    in_node = max(1, min(n, g // step))  # members of a sharding group inside one node
    g_plan = min(cp.gpus_per_node, n)  # the planner's "node" for table_row_wise (group ranks)
    lookups = _lookups_per_example(plan)
    emb = np.zeros(n)
    sent = np.zeros(n)  # bytes leaving each rank (embeddings forward; gradients come back the same way)
    recv = np.zeros(n)
    touched = np.zeros(n)  # bytes of the rows each rank's shards looked up (their gradients, for the replicas)
    intra_rs = 0.0  # table-row-wise: the intra-node reduce-scatter of partial sums, per rank
    groups, dp_bytes, ids = set(), 0.0, 0.0
    same_size = n == plan.sharding_world
    for name, t in plan.sharding["tables"].items():
        pooled, dim, kind = t["module"] == "ebc", t["dim"], t["sharding_type"]
        per_example = lookups.get(name, 0.0)
        total_lookups = n * b * per_example
        if kind == "data_parallel":
            emb += 16 * dim * b * per_example
            dp_bytes += 4 * t["rows"] * dim
            continue
        groups.add((t["module"], kind))
        # shards at this world size: (rank, share of the lookups, columns)
        if same_size:
            shards = [
                (s["rank"], s["sizes"][0] / t["rows"] if kind in ("row_wise", "table_row_wise") else 1.0, s["sizes"][1])
                for s in t["shards"]
            ]
        elif kind == "row_wise":
            shards = [(r, 1.0 / n, dim) for r in range(n)]
        elif kind == "table_row_wise":
            shards = [(r, 1.0 / g_plan, dim) for r in range(g_plan)]
        elif kind in ("column_wise", "table_column_wise"):
            k = min(len(t["shards"]), n)
            shards = [(r % n, 1.0, dim / k) for r in range(k)]
        else:  # table_wise
            shards = [(t["shards"][0]["rank"] % n, 1.0, dim)]
        for rank, share, cols in shards:
            emb[rank] += 16 * cols * total_lookups * share
            touched[rank] += 4 * cols * min(total_lookups * share, t["rows"] * share)
            if pooled and kind == "row_wise":  # partial sums of every example, reduce-scattered
                sent[rank] += 4 * cols * n * b * (n - 1) / n
            elif pooled and kind == "table_row_wise":  # reduce-scatter inside the node, then out of it
                intra_rs = max(intra_rs, 4 * cols * n * b * (g_plan - 1) / g_plan)
                sent[rank] += 4 * cols * n * b / g_plan * (n - 1) / n
            elif pooled:  # the shard's pooled outputs of every example
                sent[rank] += 4 * cols * n * b * (n - 1) / n
            else:  # sequence rows: the rows this shard looked up go to the examples' ranks
                sent[rank] += 4 * cols * total_lookups * share * (n - 1) / n
        if pooled and kind == "row_wise":  # every rank receives its examples' partial sums from all others
            recv += 4 * dim * b * (n - 1)
        elif pooled:
            recv += 4 * dim * b * (n - 1) / n
        else:
            recv += 4 * dim * b * per_example * (n - 1) / n
        ids += 8 * b * per_example * (n - 1) / n  # the ids' all-to-all (values; lengths are small)
    busiest = float(np.maximum(sent, recv).max()) if n > 1 else 0.0
    a2a = 2 * busiest + ids if n > 1 else 0.0  # forward embeddings + backward gradients
    intra_share = (in_node - 1) / (n - 1) if n > 1 else 0.0
    if in_node < g_plan:  # the group's "node" of table_row_wise spans nodes (strided groups)
        a2a, intra_rs = a2a + 2 * intra_rs / (1 - intra_share), 0.0
    replicate, shard = layout
    p = c.parallelism
    compute = DTYPE_BYTES[p.param_dtype] if plan.fsdp else 4
    reduce = DTYPE_BYTES[p.reduce_dtype] if plan.fsdp else 4
    params = plan.dense_params
    passes = 2 if p.reshard_after_forward else 1
    gather = compute * params * (shard - 1) / shard * passes if shard > 1 else 0.0
    scatter = reduce * params * (shard - 1) / shard if shard > 1 else 0.0
    replica = 2 * reduce * params / shard * (replicate - 1) / replicate if replicate > 1 else 0.0
    blocks = len(plan.block_params) + 1
    replica_tables = 2 * float(touched.max()) * (step - 1) / step if step > 1 else 0.0
    return Traffic(
        world,
        float(emb.max()),
        a2a * intra_share + 2 * intra_rs,
        a2a * (1 - intra_share),
        3 * len(groups) if n > 1 else 0,
        2 * dp_bytes * (world - 1) / world if world > 1 else 0.0,
        gather,
        scatter,
        shard <= g,
        replica,
        blocks * passes if shard > 1 else 0,
        layout,
        n,
        replica_tables,
        step <= g,
    )


def predict(plan: Plan, t: Traffic) -> Row:
    """Milliseconds per step by part, for one world size."""
    cp, c = plan.config.plan, plan.config
    flops = plan.flops_per_step or 0.0
    if c.parallelism.activation_checkpointing:  # every checkpointed block runs its forward again in backward
        flops += plan.forward_flops or 0.0
    dense = flops / (cp.peak_tflops * 1e12 * cp.mfu) * 1e3
    emb = t.embedding_bytes / (cp.hbm_gbps * 1e9 * cp.embedding_efficiency) * 1e3
    intra, inter = cp.intra_node_gbps * 1e9, cp.inter_node_gbps * 1e9
    a2a = max(t.a2a_intra / intra, t.a2a_inter / inter) * 1e3 + t.a2a_collectives * cp.collective_latency_ms
    multi_node = t.world_size > min(cp.gpus_per_node, t.world_size)
    dp_tables = t.dp_table_bytes / (inter if multi_node else intra) * 1e3
    fsdp_bw = (t.fsdp_gather_bytes + t.fsdp_reduce_bytes) / (intra if t.fsdp_intra else inter) * 1e3
    fsdp_bw += t.replica_bytes / (inter if multi_node else intra) * 1e3
    # FSDP2 overlaps its collectives with compute through CUDA streams; on a CPU (gloo) each one blocks
    exposed = max(0.0, fsdp_bw - dense) if cp.device == "cuda" else fsdp_bw
    fsdp = exposed + t.gathers * cp.collective_latency_ms
    parts = {"dense": dense, "embedding": emb, "all-to-all": a2a + dp_tables}
    if plan.group_size:  # 2-D: the replicas' all-reduce of table gradients, not overlapped
        parts["replica sync"] = t.replica_table_bytes / (intra if t.replica_intra else inter) * 1e3 + (
            cp.collective_latency_ms if t.replica_table_bytes else 0.0
        )
    parts.update({"fsdp exposed": fsdp, "overhead": cp.step_overhead_ms})
    return Row(t.world_size, parts, c.data.batch_size)


def memory_at(plan: Plan, world: int) -> float:
    """Bytes per GPU at ``world`` ranks, roughly: the sharded tables (and their optimizer state) spread
    evenly, data-parallel tables whole, the dense part under the layout at that size, the plan's
    activations, embedding I/O (none on one GPU) and reserve."""
    from gem.distributed.parallel_dims import ParallelDims
    from gem.plan.planner import SPARSE_STATE, dense_memory, uvm_cache_share

    c = plan.config
    state = SPARSE_STATE[c.optim.sparse.name]
    sharded = replicated = 0.0
    for t in plan.sharding["tables"].values():
        size = 4 * t["rows"] * t["dim"] + state(t["rows"], t["dim"])
        if t["sharding_type"] == "data_parallel":
            replicated += size + 4 * t["rows"] * t["dim"]  # + the gradient
        else:  # a table in host memory (UVM) keeps only its cache in HBM
            sharded += size * uvm_cache_share(str(t.get("compute_kernel")))
    replicate, shard = _layout(plan, world) or (1, world)
    dims = ParallelDims(replicate, shard, world, min(c.plan.gpus_per_node, world))
    dense = sum(dense_memory(c, plan.dense_params, plan.block_params, dims, plan.fsdp or world > 1).values())
    io = float(plan.memory["embedding I/O"].max())
    if plan.world_size == 1 and world > 1:
        from gem.plan.planner import embedding_io_bytes, meta_model

        io = embedding_io_bytes(plan.schema, meta_model(c, plan.schema)[0], c.data.batch_size, plan.lengths)
    sharded /= sharding_group(plan, world) or world  # 2-D: spread over a group
    return (
        sharded
        + replicated
        + dense
        + float(plan.memory["activations"].max())
        + (io if world > 1 else 0.0)
        + c.plan.reserve_gb * 2**30
    )


def step_time_table(plan: Plan) -> StepTimeTable:
    """The scaling table for ``plan.scaling`` GPU counts (and the plan's own world size)."""
    sizes = sorted(set(plan.config.plan.scaling) | {plan.world_size})
    rows, notes, skipped = [], [], []
    for w in sizes:
        t = traffic(plan, w)
        if t is None:
            skipped.append(w)
            continue
        row = predict(plan, t)
        row.memory = memory_at(plan, w)
        row.fits = row.memory <= plan.config.plan.hbm_gb * 2**30
        rows.append(row)
    if skipped:
        notes.append(
            f"skipped {skipped}: parallelism.dp_replicate x dp_shard"
            + (f" or sparse.sharding_group_size={plan.group_size}" if plan.group_size else "")
            + " does not tile them"
        )
    if not plan.flops_per_step:
        notes.append("no dense FLOP count: dense compute is left out")
    if plan.group_size:
        notes.append(
            f"tables sharded in groups of {plan.group_size} ranks (all ranks below that) and replicated "
            f"across groups; replica sync: an all-reduce of the looked-up rows' gradients every step (an "
            f"approximation: DMPCollection itself averages weights and optimizer state in sync())"
        )
    notes.append(f"tables keep the sharding types planned for {plan.sharding_world} ranks at every size")
    return StepTimeTable(rows, notes)


def plot_scaling(table: StepTimeTable, path: str | Path, title: str = "") -> Path | None:
    """The scaling table as a PNG: predicted examples/s (log-log, with linear scaling from the
    smallest row dashed) and scaling efficiency against GPUs; rows over the memory budget hollow.
    None (and one log line) when matplotlib is not installed (it is optional)."""
    import logging

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger(__name__).warning("matplotlib is not installed: no scaling plot (pip install matplotlib)")
        return None
    rows = table.rows
    gpus = np.array([r.world_size for r in rows])
    rate = np.array([r.examples_per_s for r in rows])
    eff = np.array([table.efficiency(r) for r in rows]) * 100
    fits = np.array([r.fits for r in rows])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(gpus, rate, "-", color="C0")
    a.plot(gpus, gpus / gpus[0] * rate[0], "--", color="grey", label="linear")
    for ax, y in ((a, rate), (b, eff)):
        ax.plot(gpus[fits], y[fits], "o", color="C0", label="fits")
        if (~fits).any():
            ax.plot(gpus[~fits], y[~fits], "o", mfc="none", color="C3", label="over the memory budget")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    a.set_ylabel("predicted examples/s")
    a.legend()
    b.plot(gpus, eff, "-", color="C0")
    b.set_ylabel("scaling efficiency (%)")
    b.set_ylim(0, 105)
    fig.suptitle(title or "predicted scaling (gem/plan/steptime.py)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass
class GroupChoice:
    group_size: int  # ranks the tables are sharded over (the world: 1-D)
    memory: float  # bytes on the fullest rank
    fits: bool
    row: Row | None  # the step-time model at the plan's world size
    error: str = ""  # the planner found no placement
    uvm: list[str] = field(default_factory=list)  # tables TorchRec put in host memory (UVM caching kernels)


@dataclass
class GroupComparison:
    """2-D sparse parallelism: a few ``sparse.sharding_group_size`` values at the plan's world size."""

    world_size: int
    choices: list[GroupChoice]
    configured: int

    @property
    def best(self) -> GroupChoice | None:
        ok = [c for c in self.choices if c.fits and c.row is not None]
        return max(ok, key=lambda c: (c.row.examples_per_s, -c.memory)) if ok else None

    def _override(self, c: GroupChoice) -> str:
        return f"sparse.sharding_group_size={'null' if c.group_size == self.world_size else c.group_size}"

    def text(self) -> str:
        from gem.plan.planner import _human, _table

        rows = [
            ["group size", "groups", "memory/GPU (max)", "all-to-all ms", "replica sync ms", "step ms", "examples/s"]
        ]
        for c in self.choices:
            mark = " (configured)" if c.group_size == self.configured else ""
            if c.row is None:
                rows.append([f"{c.group_size}{mark}", str(self.world_size // c.group_size), c.error, "", "", "", ""])
                continue
            p = c.row.parts_ms
            rows.append(
                [
                    f"{c.group_size}{mark}",
                    str(self.world_size // c.group_size),
                    _human(c.memory) + ("" if c.fits else " *") + (" +" if c.uvm else ""),
                    f"{p['all-to-all']:.1f}",
                    f"{p.get('replica sync', 0.0):.1f}",
                    f"{c.row.step_ms:.1f}",
                    f"{c.row.examples_per_s:,.0f}",
                ]
            )
        lines = [
            f"2-D sparse parallelism at {self.world_size} GPUs (tables sharded in groups, replicated across "
            f"them; TorchRec's planner run for each group size):",
            *_table(rows, right=(1, 2, 3, 4, 5, 6)),
        ]
        if any(not c.fits for c in self.choices if c.row is not None):
            lines.append("  * over the memory budget")
        for c in self.choices:
            if c.uvm:
                lines.append(
                    f"  + group size {c.group_size}: TorchRec's planner put {', '.join(c.uvm)} in host memory "
                    f"(UVM kernels): the memory column holds their HBM caches only; the step-time model "
                    f"still reads their lookups at HBM speed"
                )
        best = self.best
        lines.append(
            f"  recommended: {self._override(best)} (the most examples/s that fits)"
            if best
            else "  recommended: none fits; see the memory warnings"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "configured": self.configured,
            "recommended": self.best.group_size if self.best else None,
            "choices": [
                {
                    "group_size": c.group_size,
                    "memory_bytes": c.memory,
                    "fits": c.fits,
                    "error": c.error,
                    "step_ms": c.row.step_ms if c.row else None,
                    "examples_per_s": c.row.examples_per_s if c.row else None,
                }
                for c in self.choices
            ],
        }


def compare_group_sizes(plan: Plan) -> GroupComparison | None:
    """Plan the tables again for each ``plan.group_sizes`` (default: the world and 1, 2, 4 and 8 x
    ``gpus_per_node``) that divides the world, with the plan's activations, and predict each at the world size.
    None for one rank, a plan file (its placement is for one group size) or fewer than two sizes."""
    import copy

    from gem.plan.planner import make_plan
    from gem.train.config import ConfigError

    c, w = plan.config, plan.world_size
    wanted = c.plan.group_sizes
    if wanted is None:
        wanted = [w] + [k * c.plan.gpus_per_node for k in (1, 2, 4, 8)]
    sizes = sorted({g for g in [*wanted, plan.sharding_world] if 1 <= g <= w and w % g == 0})
    if w == 1 or c.sparse.plan_file or len(sizes) < 2:
        return None
    choices = []
    for g in sizes:
        if g == plan.sharding_world:
            other = plan
        else:
            config = copy.deepcopy(c)
            config.sparse.sharding_group_size = None if g == w else g
            try:
                other = make_plan(config, probe=(plan.activations, plan.activation_note))
            except ConfigError as e:
                choices.append(
                    GroupChoice(
                        g, 0.0, False, None, "no placement" if "planner" in str(e) else str(e).split(";")[0][:60]
                    )
                )
                continue
        t = traffic(other, w)
        total = other.total()
        uvm = [n for n, tb in other.sharding["tables"].items() if "uvm" in str(tb.get("compute_kernel"))]
        choices.append(
            GroupChoice(
                g,
                float(total.max()),
                bool(total.max() <= other.budget),
                predict(other, t) if t is not None else None,
                uvm=uvm,
            )
        )
    return GroupComparison(w, choices, plan.sharding_world)


def examples_per_s(plan: Plan, world: int | None = None) -> float:
    return predict(plan, traffic(plan, world or plan.world_size)).examples_per_s


# -- calibration against measured H200 runs -----------------------------------------------------------


@dataclass
class Check:
    """One measured run against the model: ``fitted`` runs set a constant, the others test it."""

    run: str
    source: str
    measured_ms: float
    predicted_ms: float
    fitted: str | None = None  # the constant this run fitted

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def _result(path, name=None, nproc=None) -> dict:
    import json

    for r in json.loads(path.read_text())["results"]:
        if (name is None or r.get("name") == name) and (nproc is None or r.get("nproc") == nproc):
            return r
    raise KeyError(f"{path}: no result {name or nproc}")


def _gem_base_plan(world: int, *overrides: str) -> Plan:
    from gem.plan.planner import make_plan
    from gem.train.api import compose
    from gem.train.config import validate

    return make_plan(
        validate(
            compose(
                [
                    "experiment=gem_base_h200",
                    "sparse=torchrec",
                    f"plan.world_size={world}",
                    f"plan.gpus_per_node={world}",
                    "plan.activations=none",
                    # the runs were measured before PMA pooled unprojected rows: their code's FLOPs
                    "model.pool_rows=false",
                    *overrides,
                ]
            )
        )
    )


def _as_data_parallel(plan: Plan) -> Plan:
    """The scaling runs' tables: native, replicated under DDP (gradients all-reduced)."""
    for t in plan.sharding["tables"].values():
        t["sharding_type"], t["shards"], t["ranks"] = "data_parallel", [], None
    return plan


def calibrate(results: str | Path = None) -> tuple[dict[str, float], list[Check]]:
    """Fit ``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.collective_latency_ms`` to the H200
    runs of gem_base (``experiment=gem_base_h200``, batch 1024, bf16) and predict the others.

    - ``embedding_efficiency``: the embedding kernels' 1.50 ms per step of the sharded run
      (FBGEMM, TorchRec's pipeline; e2e-h200-fbgemm.json, profiler) against the modelled bytes;
    - ``mfu``: the rest of that run's 59.9 ms step is dense compute;
    - ``collective_latency_ms``: what FSDP's all-gathers add on two GPUs (scaling-h200.json) beyond
      their bandwidth time, per all-gather. Those runs were made two days earlier, with code at half
      the speed of the e2e runs, so each 2-GPU prediction starts from the measured 1-GPU step of its
      own file and predicts only what the second GPU adds.

    Every run was measured when PMA projected the rows (``model.pool_rows=false``), so the plans
    count that code's FLOPs.
    """

    root = Path(results) if results else Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    fb = _result(root / "e2e-h200-fbgemm.json", "fbgemm-interformer")
    base = _gem_base_plan(1)
    cp = base.config.plan
    t1 = traffic(base, 1)
    emb_ms = fb["breakdown"]["ms_per_step_by_kind"]["embedding"]
    eff = t1.embedding_bytes / (emb_ms * 1e-3 * cp.hbm_gbps * 1e9)
    mfu = base.flops_per_step / ((fb["step_ms"] - emb_ms) * 1e-3 * cp.peak_tflops * 1e12)
    fitted = {"mfu": mfu, "embedding_efficiency": eff}

    def with_constants(plan: Plan, **extra) -> Plan:
        for key, value in {**fitted, **extra}.items():
            setattr(plan.config.plan, key, value)
        return plan

    checks = [
        Check(
            "gem_base InterFormer, sharded tables (FBGEMM, pipeline), 1 GPU",
            "e2e-h200-fbgemm.json",
            fb["step_ms"],
            predict(with_constants(base), t1).step_ms,
            "mfu, embedding_efficiency",
        )
    ]
    for name, block in (("interformer", "interformer"), ("kunlun", "kunlun")):
        r = _result(root / "e2e-h200.json", name)
        plan = with_constants(_gem_base_plan(1, f"model.block={block}"))
        checks.append(
            Check(
                f"gem_base {block}, native tables, 1 GPU (another machine)",
                "e2e-h200.json",
                r["step_ms"],
                predict(plan, traffic(plan, 1)).step_ms,
            )
        )
    # FSDP on two GPUs: the latency per all-gather, then the other two layouts
    runs = {
        "fsdp": ("scaling-h200.json", ["parallelism=fsdp"]),
        "fsdp, reshard_after_forward=false": (
            "scaling-h200-fsdp-gathered.json",
            ["parallelism=fsdp", "parallelism.reshard_after_forward=false"],
        ),
        "replicate": ("scaling-h200-replicate.json", ["parallelism=replicate"]),
    }
    latency = None
    for label, (file, overrides) in runs.items():
        one, two = _result(root / file, nproc=1)["step_ms"], _result(root / file, nproc=2)["step_ms"]
        plan = with_constants(_as_data_parallel(_gem_base_plan(2, *overrides)), collective_latency_ms=0.0)
        added0 = predict(plan, traffic(plan, 2)).step_ms - predict(plan, traffic(plan, 1)).step_ms
        gathers = traffic(plan, 2).gathers
        if latency is None:
            latency = (two - one - added0) / gathers
            fitted["collective_latency_ms"] = latency
        plan.config.plan.collective_latency_ms = latency
        added = predict(plan, traffic(plan, 2)).step_ms - predict(plan, traffic(plan, 1)).step_ms
        checks.append(
            Check(
                f"gem_base InterFormer, {label}, 2 GPUs (from the file's 1-GPU step {one:.1f} ms)",
                file,
                two,
                one + added,
                "collective_latency_ms" if label == "fsdp" else None,
            )
        )
    return fitted, checks
