"""The step-time model against gloo trainings on this CPU: what benchmarks/plan_cpu.py runs and fits.

A rank is one process of ``trainer.num_threads=1`` thread (one core: the model's "device"), the
link between ranks gloo over loopback. The machine's constants are measured
(gem/plan/machine.py): ``plan.peak_tflops`` (matmul), ``plan.hbm_gbps`` (copy), each with as many
processes at once as the run has ranks (ranks on one host share it), and
``plan.intra_node_gbps`` / ``plan.collective_latency_ms`` (gloo all-to-all). Three are fitted, by
least squares, to the one-rank :data:`RUNS` marked ``fit`` (table-wise, different batches and
shapes, so that dense FLOPs, lookup bytes and steps vary independently):

    step ms = dense FLOPs / (peak x mfu) + lookup bytes / (hbm x embedding_efficiency) + overhead

``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.step_overhead_ms`` (the host's per-step
work: Python, TorchRec's input handling, optimizer launches; on a GPU it hides behind the device,
on a CPU it is the same core). The other runs are predicted with those constants: one rank at
another shape, and two ranks with table-wise and row-wise tables, FSDP and replicated dense, where
the all-to-all and FSDP terms come from the measured link alone.

Measured step time is the trainer's ``step_ms`` less its data wait (``data.num_workers=0``: the
loader runs in the step; the model leaves the input pipeline out), the median over logged windows
after warm-up, then over repeats. The results, and which of the model's terms miss on a CPU host:
docs/planning.md, "On a CPU host".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem.plan.machine import CPUMachine
from gem.plan.steptime import Check, predict, traffic

# Every run: a DLRM wide enough that its matmuls, not Python, set the step; fp32 on one thread per rank.
BASE = (
    "debug=tiny",
    "model=dlrm",
    "model.dim=64",
    "model.bottom_mlp=[256]",
    "model.top_mlp=[1024,1024,256]",
    "sparse=torchrec",
    "sparse.embedding_dim=64",
    "trainer.device=cpu",
    "trainer.num_threads=1",
    "data.num_workers=0",
    "data.num_examples.train=20000",
    "trainer.log_every=5",
    "trainer.plots=false",
)
NARROW = ("model.top_mlp=[256,128]", "sparse.embedding_dim=128")  # lookups outweigh the matmuls


@dataclass(frozen=True)
class CPURun:
    name: str
    nproc: int
    overrides: tuple[str, ...]
    fit: bool = False  # fitted on, else held out
    steps: int = 40

    @property
    def label(self) -> str:
        return f"{self.name}, {self.nproc} rank{'s' * (self.nproc > 1)}"


RUNS = (
    CPURun("table_wise, batch 256", 1, ("sparse.sharding_type=table_wise", "data.batch_size=256"), fit=True),
    CPURun("table_wise, batch 1024", 1, ("sparse.sharding_type=table_wise", "data.batch_size=1024"), fit=True),
    CPURun(
        "table_wise, narrow MLP, dim 128, batch 512",
        1,
        ("sparse.sharding_type=table_wise", "data.batch_size=512", *NARROW),
        fit=True,
    ),
    CPURun(
        "table_wise, narrow MLP, dim 128, batch 2048",
        1,
        ("sparse.sharding_type=table_wise", "data.batch_size=2048", *NARROW),
        fit=True,
        steps=30,
    ),
    CPURun("table_wise, batch 512", 1, ("sparse.sharding_type=table_wise", "data.batch_size=512")),
    CPURun("table_wise, FSDP, batch 512", 2, ("sparse.sharding_type=table_wise", "data.batch_size=512")),
    CPURun("row_wise, FSDP, batch 512", 2, ("sparse.sharding_type=row_wise", "data.batch_size=512")),
    CPURun(
        "row_wise, replicated dense, batch 512",
        2,
        (
            "sparse.sharding_type=row_wise",
            "data.batch_size=512",
            "parallelism=replicate",
            "parallelism.param_dtype=float32",
        ),
    ),
    CPURun(
        "row_wise, FSDP, narrow MLP, dim 128, batch 512",
        2,
        ("sparse.sharding_type=row_wise", "data.batch_size=512", *NARROW),
    ),
)


def train_overrides(run: CPURun) -> list[str]:
    """``python -m gem.train`` overrides of ``run`` (torchrun adds the ranks)."""
    return [*BASE, *run.overrides, f"trainer.max_steps={run.steps}"]


def run_plan(run: CPURun, constants: list[str]):
    """The plan of ``run`` for its ranks on one host, with ``constants`` (``plan.*`` overrides)."""
    from gem.plan.planner import make_plan
    from gem.train.api import compose
    from gem.train.config import validate

    world = [f"plan.world_size={run.nproc}", f"plan.gpus_per_node={run.nproc}", "plan.activations=none"]
    return make_plan(validate(compose([*train_overrides(run), *world, *constants])))


def _unit_parts(run: CPURun, machine: list[str]) -> dict[str, float]:
    """The model's parts (ms) of ``run`` with mfu = embedding_efficiency = 1 and no overhead."""
    unit = ["plan.mfu=1", "plan.embedding_efficiency=1", "plan.step_overhead_ms=0"]
    plan = run_plan(run, [*machine, *unit])
    return predict(plan, traffic(plan, run.nproc)).parts_ms


def fit(
    measured: dict[str, float], machine: CPUMachine, rates: dict[str, dict[str, float]] | None = None
) -> tuple[dict[str, float], list[Check], dict]:
    """Fit ``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.step_overhead_ms`` to the ``fit`` runs'
    measured step ms (``measured``: run label -> ms), predict every run, and return the constants, one
    :class:`Check` per measured run and each run's predicted parts (ms). Each run gets the machine's
    compute and memory rates at its number of ranks: ``rates[label]`` (measured beside the run, as
    the host's load drifts) where given, else ``machine``'s."""
    rates = rates or {}
    runs = [r for r in RUNS if r.label in measured]
    host = {r.label: machine.overrides(r.nproc, rates.get(r.label)) for r in runs}
    fitting = [r for r in runs if r.fit]
    unit = {r.label: _unit_parts(r, host[r.label]) for r in fitting}
    if len(fitting) < 3:
        raise ValueError(f"the CPU fit needs the 3+ runs marked fit, got {[r.label for r in fitting]}")
    # step - communication = dense0 / mfu + emb0 / eff + overhead
    a = np.array([[unit[r.label]["dense"], unit[r.label]["embedding"], 1.0] for r in fitting])
    rest = [sum(v for k, v in unit[r.label].items() if k not in ("dense", "embedding")) for r in fitting]
    y = np.array([measured[r.label] - c for r, c in zip(fitting, rest)])
    w = 1.0 / y  # relative error: the small runs count as much as the large
    (inv_mfu, inv_eff, overhead), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if inv_mfu <= 0 or inv_eff <= 0:
        raise ValueError(
            f"the CPU fit gave a negative rate (1/mfu={inv_mfu:.3g}, 1/embedding_efficiency={inv_eff:.3g}): "
            "the fitting runs do not separate dense from lookup time; rerun on a quieter machine"
        )
    fitted = {"mfu": 1.0 / inv_mfu, "embedding_efficiency": 1.0 / inv_eff, "step_overhead_ms": float(overhead)}
    constants = [f"plan.{k}={v:.6g}" for k, v in fitted.items()]
    checks, parts = [], {}
    for r in runs:
        plan = run_plan(r, [*host[r.label], *constants])
        row = predict(plan, traffic(plan, r.nproc))
        parts[r.label] = row.parts_ms
        checks.append(
            Check(
                r.label,
                "plan_model-cpu.json",
                measured[r.label],
                row.step_ms,
                "mfu, embedding_efficiency, step_overhead_ms" if r.fit else None,
            )
        )
    return fitted, checks, parts


# The profiler's operators (benchmarks/plan_cpu.py --profile) by the model's part: the first part whose
# pattern occurs in the lower-cased name wins; the rest is dense work (matmuls, elementwise, AdamW).
PROFILE_PARTS = {
    "data": ("dataloader",),
    "fsdp": ("fsdp::", "_allgather_base", "_reduce_scatter_base", "allreduce", "all_reduce"),
    "all-to-all": ("all2all", "alltoall", "reducescatterbase", "awaitable", "wait()"),
    "input dist": ("permute_2d_sparse_data", "bucketize", "bounds_check_indices"),
    "embedding": ("split_embedding", "index_select", "scatter_add", "index_put", "embedding"),
}


def profile_parts(ops: list[dict]) -> dict[str, float]:
    """Milliseconds per step by the model's part, from a profile breakdown's ``top`` operators
    (gem/train/profile.py; ``trainer.profile.top`` large enough to list them all)."""
    out = {part: 0.0 for part in (*PROFILE_PARTS, "dense")}
    for op in ops:
        name = op["name"].lower()
        part = next((p for p, pats in PROFILE_PARTS.items() if any(x in name for x in pats)), "dense")
        out[part] += op["ms_per_step"]
    return out
