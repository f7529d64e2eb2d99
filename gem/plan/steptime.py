"""A step-time model: predicted examples/s and scaling efficiency of a plan for 1 .. 4096 GPUs.

One training step of one rank, every rank with ``B = data.batch_size`` examples, ``W`` ranks in
nodes of ``G``::

    step = dense compute + embedding traffic + sparse all-to-all + exposed FSDP collectives + overhead

- **dense compute**: the arch's forward + backward FLOPs on the sampled history lengths
  (``flops()``, gem/train/flops.py) over ``plan.peak_tflops x plan.mfu``.
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
        head = ["GPUs", "step ms", *[p + " ms" for p in parts], "examples/s", "efficiency"]
        table = [head] + [[str(r.world_size), f"{r.step_ms:.1f}", *[f"{r.parts_ms[p]:.1f}" for p in parts],
                           f"{r.examples_per_s:,.0f}", f"{self.efficiency(r):.1%}"] for r in self.rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(head))]
        lines = ["predicted step time (gem/plan/steptime.py; efficiency = examples/s over GPUs x the smallest "
                 "row's per GPU):"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in
                  [table[0], ["-" * w for w in widths], *table[1:]]]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def to_json(self) -> dict:
        return {"rows": [{"world_size": r.world_size, "step_ms": r.step_ms, "examples_per_s": r.examples_per_s,
                          "efficiency": self.efficiency(r), "parts_ms": r.parts_ms} for r in self.rows],
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
    dense = plan.flops_per_step / (cp.peak_tflops * 1e12 * cp.mfu) * 1e3 if plan.flops_per_step else 0.0
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


def step_time_table(plan: Plan) -> StepTimeTable:
    """The scaling table for ``plan.scaling`` GPU counts (and the plan's own world size)."""
    sizes = sorted(set(plan.config.plan.scaling) | {plan.world_size})
    rows, notes, skipped = [], [], []
    for w in sizes:
        t = traffic(plan, w)
        if t is None:
            skipped.append(w)
            continue
        rows.append(predict(plan, t))
    if skipped:
        notes.append(f"skipped {skipped}: parallelism.dp_replicate x dp_shard does not tile them")
    if not plan.flops_per_step:
        notes.append("no dense FLOP count: dense compute is left out")
    notes.append(f"tables keep the sharding types planned for {plan.world_size} ranks at every size")
    return StepTimeTable(rows, notes)


def examples_per_s(plan: Plan, world: int | None = None) -> float:
    return predict(plan, traffic(plan, world or plan.world_size)).examples_per_s
