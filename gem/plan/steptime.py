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
  and across replicas an all-reduce of the shards; bandwidth time hides behind the dense compute,
  but every all-gather waits ``plan.collective_latency_ms``: calibrated on two H200s, where
  FSDP's 34 all-gathers per step added 26 ms that bandwidth does not explain.
- **data-parallel tables**: an all-reduce of their full gradient.

Other world sizes than the plan's keep each table's sharding type (row-wise over all ranks,
table-wise on one, column-wise over its shard count, table-row-wise over a node), with the
placement TorchRec's planner chose at ``plan.world_size``; the planner is not run again per size.
``calibrate()`` fits ``mfu``, ``embedding_efficiency`` and ``collective_latency_ms`` to the
measured H200 runs (benchmarks/results/e2e-h200*.json, scaling-h200*.json) and reports the
model's error on the runs it was not fitted to (benchmarks/plan_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        table = [head] + [[str(r.world_size), f"{r.step_ms:.1f}", *[f"{r.parts_ms[p]:.1f}" for p in parts],
                           f"{r.examples_per_s:,.0f}", f"{self.efficiency(r):.1%}",
                           f"{r.memory / 2**30:.1f}" + ("" if r.fits else " *")] for r in self.rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(head))]
        lines = ["predicted step time (gem/plan/steptime.py; efficiency = examples/s over GPUs x the smallest "
                 "row's per GPU):"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in
                  [table[0], ["-" * w for w in widths], *table[1:]]]
        if not all(r.fits for r in self.rows):
            lines.append("  * over the memory budget at that size (tables spread evenly; the step time assumes it fits)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def to_json(self) -> dict:
        return {"rows": [{"world_size": r.world_size, "step_ms": r.step_ms, "examples_per_s": r.examples_per_s,
                          "efficiency": self.efficiency(r), "parts_ms": r.parts_ms, "memory_bytes": r.memory,
                          "fits": r.fits} for r in self.rows],
                "notes": self.notes}


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
        plan._table_features = {t.name: list(t.feature_names)
                                for t in build_tables(plan.schema, s.embedding_dim, s.init_scale, s.dims)}
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


def traffic(plan: Plan, world: int) -> Traffic | None:
    """The per-step bytes of ``plan`` at ``world`` ranks (module docstring)."""
    c, cp = plan.config, plan.config.plan
    layout = _layout(plan, world)
    if layout is None:
        return None
    b = c.data.batch_size
    g = min(cp.gpus_per_node, world)
    lookups = _lookups_per_example(plan)
    emb = np.zeros(world)
    sent = np.zeros(world)  # bytes leaving each rank (embeddings forward; gradients come back the same way)
    recv = np.zeros(world)
    intra_rs = 0.0  # table-row-wise: the intra-node reduce-scatter of partial sums, per rank
    groups, dp_bytes, ids = set(), 0.0, 0.0
    same_size = world == plan.world_size
    for name, t in plan.sharding["tables"].items():
        pooled, dim, kind = t["module"] == "ebc", t["dim"], t["sharding_type"]
        per_example = lookups.get(name, 0.0)
        total_lookups = world * b * per_example
        if kind == "data_parallel":
            emb += 16 * dim * b * per_example
            dp_bytes += 4 * t["rows"] * dim
            continue
        groups.add((t["module"], kind))
        # shards at this world size: (rank, share of the lookups, columns)
        if same_size:
            shards = [(s["rank"], s["sizes"][0] / t["rows"] if kind in ("row_wise", "table_row_wise") else 1.0,
                       s["sizes"][1]) for s in t["shards"]]
        elif kind == "row_wise":
            shards = [(r, 1.0 / world, dim) for r in range(world)]
        elif kind == "table_row_wise":
            shards = [(r, 1.0 / g, dim) for r in range(g)]
        elif kind in ("column_wise", "table_column_wise"):
            k = min(len(t["shards"]), world)
            shards = [(r % world, 1.0, dim / k) for r in range(k)]
        else:  # table_wise
            shards = [(t["shards"][0]["rank"] % world, 1.0, dim)]
        for rank, share, cols in shards:
            emb[rank] += 16 * cols * total_lookups * share
            if pooled and kind == "row_wise":  # partial sums of every example, reduce-scattered
                sent[rank] += 4 * cols * world * b * (world - 1) / world
            elif pooled and kind == "table_row_wise":  # reduce-scatter inside the node, then out of it
                intra_rs = max(intra_rs, 4 * cols * world * b * (g - 1) / g)
                sent[rank] += 4 * cols * world * b / g * (world - 1) / world
            elif pooled:  # the shard's pooled outputs of every example
                sent[rank] += 4 * cols * world * b * (world - 1) / world
            else:  # sequence rows: the rows this shard looked up go to the examples' ranks
                sent[rank] += 4 * cols * total_lookups * share * (world - 1) / world
        if pooled and kind == "row_wise":  # every rank receives its examples' partial sums from all others
            recv += 4 * dim * b * (world - 1)
        elif pooled:
            recv += 4 * dim * b * (world - 1) / world
        else:
            recv += 4 * dim * b * per_example * (world - 1) / world
        ids += 8 * b * per_example * (world - 1) / world  # the ids' all-to-all (values; lengths are small)
    busiest = float(np.maximum(sent, recv).max()) if world > 1 else 0.0
    a2a = 2 * busiest + ids if world > 1 else 0.0  # forward embeddings + backward gradients
    intra_share = (g - 1) / (world - 1) if world > 1 else 0.0
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
    return Traffic(world, float(emb.max()), a2a * intra_share + 2 * intra_rs, a2a * (1 - intra_share),
                   3 * len(groups) if world > 1 else 0, 2 * dp_bytes * (world - 1) / world if world > 1 else 0.0,
                   gather, scatter, shard <= g, replica, blocks * passes if shard > 1 else 0, layout)


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
    fsdp = max(0.0, fsdp_bw - dense) + t.gathers * cp.collective_latency_ms
    return Row(t.world_size, {"dense": dense, "embedding": emb, "all-to-all": a2a + dp_tables,
                              "fsdp exposed": fsdp, "overhead": cp.step_overhead_ms}, c.data.batch_size)


def memory_at(plan: Plan, world: int) -> float:
    """Bytes per GPU at ``world`` ranks, roughly: the sharded tables (and their optimizer state) spread
    evenly, data-parallel tables whole, the dense part under the layout at that size, the plan's
    activations, embedding I/O (none on one GPU) and reserve."""
    from gem.distributed.parallel_dims import ParallelDims
    from gem.plan.planner import SPARSE_STATE, dense_memory

    c = plan.config
    state = SPARSE_STATE[c.optim.sparse.name]
    sharded = replicated = 0.0
    for t in plan.sharding["tables"].values():
        size = 4 * t["rows"] * t["dim"] + state(t["rows"], t["dim"])
        if t["sharding_type"] == "data_parallel":
            replicated += size + 4 * t["rows"] * t["dim"]  # + the gradient
        else:
            sharded += size
    replicate, shard = _layout(plan, world) or (1, world)
    dims = ParallelDims(replicate, shard, world, min(c.plan.gpus_per_node, world))
    dense = sum(dense_memory(c, plan.dense_params, plan.block_params, dims, plan.fsdp or world > 1).values())
    io = float(plan.memory["embedding I/O"].max())
    if plan.world_size == 1 and world > 1:
        from gem.plan.planner import embedding_io_bytes, meta_model

        io = embedding_io_bytes(plan.schema, meta_model(c, plan.schema)[0], c.data.batch_size, plan.lengths)
    return (sharded / world + replicated + dense + float(plan.memory["activations"].max()) + (io if world > 1 else 0.0)
            + c.plan.reserve_gb * 2**30)


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
        notes.append(f"skipped {skipped}: parallelism.dp_replicate x dp_shard does not tile them")
    if not plan.flops_per_step:
        notes.append("no dense FLOP count: dense compute is left out")
    notes.append(f"tables keep the sharding types planned for {plan.world_size} ranks at every size")
    return StepTimeTable(rows, notes)


def plot_scaling(table: StepTimeTable, path: "str | Path", title: str = "") -> "Path | None":
    """The scaling table as a PNG: predicted examples/s (log-log, with linear scaling from the
    smallest row dashed) and scaling efficiency against GPUs; rows over the memory budget hollow.
    None (and one log line) when matplotlib is not installed (it is optional)."""
    import logging
    from pathlib import Path

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

    return make_plan(validate(compose(["experiment=gem_base_h200", "sparse=torchrec", f"plan.world_size={world}",
                                       f"plan.gpus_per_node={world}", "plan.activations=none", *overrides])))


def _as_data_parallel(plan: Plan) -> Plan:
    """The scaling runs' tables: native, replicated under DDP (gradients all-reduced)."""
    for t in plan.sharding["tables"].values():
        t["sharding_type"], t["shards"], t["ranks"] = "data_parallel", [], None
    return plan


def calibrate(results: "str | Path" = None) -> tuple[dict[str, float], list[Check]]:
    """Fit ``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.collective_latency_ms`` to the H200
    runs of gem_base (``experiment=gem_base_h200``, batch 1024, bf16) and predict the others.

    - ``embedding_efficiency``: the embedding kernels' 1.50 ms per step of the sharded run
      (FBGEMM, TorchRec's pipeline; e2e-h200-fbgemm.json, profiler) against the modelled bytes;
    - ``mfu``: the rest of that run's 59.9 ms step is dense compute;
    - ``collective_latency_ms``: what FSDP's all-gathers add on two GPUs (scaling-h200.json) beyond
      their bandwidth time, per all-gather. Those runs were made two days earlier, with code at half
      the speed of the e2e runs, so each 2-GPU prediction starts from the measured 1-GPU step of its
      own file and predicts only what the second GPU adds.
    """
    from pathlib import Path

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

    checks = [Check("gem_base InterFormer, sharded tables (FBGEMM, pipeline), 1 GPU", "e2e-h200-fbgemm.json",
                    fb["step_ms"], predict(with_constants(base), t1).step_ms, "mfu, embedding_efficiency")]
    for name, block in (("interformer", "interformer"), ("kunlun", "kunlun")):
        r = _result(root / "e2e-h200.json", name)
        plan = with_constants(_gem_base_plan(1, f"model.block={block}"))
        checks.append(Check(f"gem_base {block}, native tables, 1 GPU (another machine)", "e2e-h200.json",
                            r["step_ms"], predict(plan, traffic(plan, 1)).step_ms))
    # FSDP on two GPUs: the latency per all-gather, then the other two layouts
    runs = {"fsdp": ("scaling-h200.json", ["parallelism=fsdp"]),
            "fsdp, reshard_after_forward=false": ("scaling-h200-fsdp-gathered.json",
                                                  ["parallelism=fsdp", "parallelism.reshard_after_forward=false"]),
            "replicate": ("scaling-h200-replicate.json", ["parallelism=replicate"])}
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
        checks.append(Check(f"gem_base InterFormer, {label}, 2 GPUs (from the file's 1-GPU step {one:.1f} ms)",
                            file, two, one + added, "collective_latency_ms" if label == "fsdp" else None))
    return fitted, checks
