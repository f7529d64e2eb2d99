"""Knowledge transfer (#25): a GEM teacher and small DLRM students, alone and with each transfer
route (distillation, representations, shared tables, the adapter) and all together; AUC / NE (and,
on ranking data, HR@10 / NDCG@10) on the students' test data, and FLOPs per example.

    python benchmarks/transfer.py [--set synthetic|lastfm] [--out ...]   # one seed

``--set synthetic`` (``benchmarks/results/transfer-cpu.json``): the teacher (``model=gem_tiny``)
trains on the synthetic world at drift 0 with many examples; the students train on fewer examples
of a later period (``data.synthetic.drift``) and are tested on that period's test split.

``--set lastfm`` (``benchmarks/results/transfer-cpu-lastfm.json``): LastFM (S3-Rec format,
``data.kind=seqrec``, the pointwise ranking objective, leave-one-out with 99 negatives per test
user). The teacher (``model=gem_tiny``, an InterFormer block over the event history) trains on every
training target of every user; the students on each user's most recent few targets
(``data.seqrec.max_targets_per_user``): less data, as a value model of one surface has.

Both: the teacher's logits and representation are exported onto the students' data
(``python -m gem.transfer.export transfer.representation=heads``, and a second copy with
``transfer.representation=history``, the candidate's id features left out); every student trains on
such a copy (the columns are ignored where a route is off), so all rows see the same examples. Each student
trains for up to ``--max-epochs``, its validation split scored after every epoch; its row is the
test score of the same run stopped after its best validation epoch (early stopping: the small
fresh data is overfitted within a few epochs, by every route differently). Shared tables:
``checkpoint.init_from`` the teacher's checkpoint, every table, trained on. FLOPs per example:
forward, ``torch.utils.flop_counter.FlopCounterMode`` over one test batch (matmuls; embedding
lookups are not FLOPs), the same counter for every model. ``serving_flops`` is per candidate: it
adds the teacher's forward to the rows whose student reads the teacher's per-candidate outputs
(head-input representations, adapter: the teacher runs for every candidate), and the teacher's
history pass (``per_request_flops``, counted the same way) divided by ``--candidates-per-request``
to the rows that read the history representation (computed once per request, shared by its candidates).
``seed_study`` (``--seeds``, 3): the student alone and the representation rows again over training
seeds, their test score's mean and range, since one seed is within the noise for those rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402

TEACHER = "teacher"


def compose(overrides):
    from gem.train.api import compose as _compose

    return _compose(overrides)


def forward_flops_per_example(model, batch) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch)
    return counter.get_total_flops() / batch.batch_size


def setups(args) -> dict:
    """Per data set: the overrides of the teacher's data, the students' data, both models, the metric keys."""
    common = ["trainer.device=cpu", "trainer.progress_bar=false", "trainer.plots=false", "data.num_workers=0"]
    if args.set == "synthetic":
        return {
            "common": [*common, "trainer.log_every=100"],
            "teacher_data": [f"data.num_examples={{train: {args.teacher_examples}, val: 2000, test: 2000}}"],
            "student_data": [
                f"data.num_examples={{train: {args.student_examples}, val: 2000, test: {args.test_examples}}}",
                f"data.synthetic.drift={args.drift}",
            ],
            "teacher_model": ["model=gem_tiny", "model.dim=32", "model.num_layers=2", "trainer.epochs=1"],
            "student_model": ["model=dlrm", "model.dim=16", "model.bottom_mlp=[32]", "model.top_mlp=[32]"],
            "max_epochs": args.max_epochs or 4,
            "batch_size": 256,
            "student_train": [],
            "metrics": ("click/auc", "click/ne", "conversion/auc", "conversion/ne"),
            "gap_metrics": ("click/auc",),
            "candidate_features": ("ad_id", "ad_cluster"),
        }
    seqrec = [
        "experiment=seqrec",
        "data.name=LastFM",
        f"data.seqrec.max_eval_users={args.eval_users}",
        "trainer.log_every=50",
    ]
    return {
        "common": [*common, *seqrec],
        "teacher_data": [],
        "student_data": [f"data.seqrec.max_targets_per_user={args.student_targets}"],
        "teacher_model": ["model=gem_tiny", "model.dim=32", f"trainer.epochs={args.teacher_epochs}"],
        "student_model": ["model=dlrm", "model.dim=16", "model.bottom_mlp=[16]", "model.top_mlp=[32]"],
        "max_epochs": args.max_epochs or 6,  # 64 steps an epoch of 256 rows
        "batch_size": 256,
        # experiment=seqrec's settings, which the students' data=parquet runs do not compose
        "student_train": [
            "data.batch_size=256",
            "data.eval_batch_size=5000",
            "sparse.embedding_dim=32",
            "optim.dense.lr=0.002",
            "optim.sparse.lr=0.05",
        ],
        "metrics": ("next_item/auc", "next_item/ne", "next_item/hr@10", "next_item/ndcg@10"),
        "gap_metrics": ("next_item/auc", "next_item/hr@10"),
        "candidate_features": ("item_id", "item_attr"),  # those of them the schema has
    }


# what a student row needs from the teacher at serving time
ALONE, PER_CANDIDATE, PER_REQUEST = "nothing", "a forward per candidate", "a history pass per request"


def variants(args, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    """The student rows: overrides on top of the student's model and its exported data, and what
    each needs from the teacher at serving (the history rows train on the history export)."""
    distill = [f"trainer.distill.weight={args.distill_weight}", f"trainer.distill.temperature={args.temperature}"]
    rep = [f"trainer.distill.representation={args.representation}"]
    shared = [f"checkpoint.init_from={ckpt}", "checkpoint.init_modules=[sparse_arch]"]
    adapter = ["trainer.distill.adapter=true"]
    return {
        "student alone": ([], ALONE),
        "student + distillation": (distill, ALONE),
        "student + representations": (rep, PER_CANDIDATE),
        "student + history representation": (rep, PER_REQUEST),
        "student + shared tables": (shared, ALONE),
        "student + adapter": (adapter, PER_CANDIDATE),
        "student + distillation + shared tables": ([*distill, *shared], ALONE),  # the cheapest that combines
        "student + distillation + shared tables + history": ([*distill, *shared, *rep], PER_REQUEST),
        "student, all together": ([*distill, *rep, *shared, *adapter], PER_CANDIDATE),
    }


def val_curve(run_dir: Path, key: str) -> list[float]:
    """``key`` on the validation split after each evaluation of a run (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["kind"] == "val"]


def train_selected(overrides, run_dir: Path, max_epochs: int, steps_per_epoch: int, key: str):
    """Train for ``max_epochs``, scoring the validation split after each; then again for the epoch
    count whose validation ``key`` was best (the same seed: the same trajectory up to there, which
    its last validation score checks). Returns (test metrics, what was chosen)."""
    from gem.train.trainer import train

    shutil.rmtree(run_dir, ignore_errors=True)
    every = [f"trainer.eval_every={steps_per_epoch}"]
    probe = run_dir / "select"
    test = train(compose([*overrides, *every, f"trainer.run_dir={probe}", f"trainer.epochs={max_epochs}"]))
    curve = val_curve(probe, key)[:max_epochs]
    best = 1 + max(range(len(curve)), key=curve.__getitem__)
    chosen = {"epochs": best, f"val_{key}_by_epoch": curve}
    if best < max_epochs:
        final = run_dir / "final"
        test = train(compose([*overrides, *every, f"trainer.run_dir={final}", f"trainer.epochs={best}"]))
        chosen["reproduced"] = abs(val_curve(final, key)[-1] - curve[best - 1]) < 1e-6
    return test, chosen


def seed_study(args, base: list[str], data: dict[str, list[str]], work: Path, max_epochs: int, steps: int, key: str):
    """The student alone and the representation rows over ``--seeds`` training seeds (one seed is
    within the noise for these inputs): each row's test ``key`` per seed, early-stopped as in the table.
    ``data``: the overrides of each export (``heads``, ``history``)."""
    rep = lambda p: [f"trainer.distill.representation={p}"]  # noqa: E731
    rows = {
        "student alone": (data["heads"], []),
        f"student + representations (P={args.representation})": (data["heads"], rep(args.representation)),
        f"student + history representation (P={args.representation})": (data["history"], rep(args.representation)),
        "student + history representation (P=4)": (data["history"], rep(4)),
    }
    out = {}
    for name, (on, extra) in rows.items():
        scores = []
        for seed in range(args.seeds):
            run_dir = work / "seeds" / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}_{seed}"  # a Hydra-safe value
            test, _ = train_selected([*on, *base, *extra, f"trainer.seed={seed}"], run_dir, max_epochs, steps, key)
            scores.append(test[key])
        out[name] = {key: scores, "mean": sum(scores) / len(scores), "min": min(scores), "max": max(scores)}
    return out


def history_per_request(directory: Path, split: str = "test") -> bool | None:
    """Whether every row of one ``request_id`` (the candidates of one request) carries the same history
    representation in the exported ``split`` (None: the data has no request ids)."""
    import numpy as np

    same = []
    for f in sorted((directory / split).glob("*.parquet")):
        table = (
            pq.read_table(f, columns=["request_id", "teacher_repr"])
            if "request_id" in pq.read_schema(f).names
            else None
        )
        if table is None:
            return None
        ids = table.column("request_id").to_numpy()
        rep = np.stack(table.column("teacher_repr").to_numpy(zero_copy_only=False))
        first = {r: i for i, r in reversed(list(enumerate(ids)))}  # each request's first row
        same.append(bool(np.array_equal(rep, rep[[first[r] for r in ids]])))
    return all(same) if same else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("synthetic", "lastfm"), default="synthetic")
    parser.add_argument("--teacher-examples", type=int, default=60000, help="synthetic")
    parser.add_argument("--student-examples", type=int, default=15000, help="synthetic")
    parser.add_argument("--test-examples", type=int, default=20000, help="synthetic")
    parser.add_argument("--drift", type=float, default=0.3, help="synthetic")
    parser.add_argument("--student-targets", type=int, default=3, help="lastfm: training targets per user")
    parser.add_argument("--eval-users", type=int, default=300, help="lastfm: sampled val / test users")
    parser.add_argument("--teacher-epochs", type=int, default=1, help="lastfm")
    parser.add_argument("--distill-weight", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--representation", type=int, default=16, help="trainer.distill.representation")
    parser.add_argument(
        "--candidates-per-request", type=int, default=100, help="candidates sharing one history pass, for serving"
    )
    parser.add_argument("--max-epochs", type=int, default=None, help="student epochs at most (synthetic 4, lastfm 6)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the representation rows' study (1: none)")
    parser.add_argument("--work", default=None, help="default /tmp/gem-transfer-bench[-lastfm]")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    suffix = "" if args.set == "synthetic" else f"-{args.set}"
    work = Path(args.work or f"/tmp/gem-transfer-bench{suffix}")
    out_path = Path(args.out or ROOT / f"benchmarks/results/transfer-cpu{suffix}.json")

    import gem
    from gem.data.sources import build_source
    from gem.train.checkpoint import list_checkpoints
    from gem.train.config import validate
    from gem.train.evaluation import evaluate
    from gem.train.setup import DistEnv, split_loader
    from gem.train.trainer import train
    from gem.transfer.export import ExportConfig
    from gem.transfer.export import run as export
    from gem.transfer.teacher import load_teacher

    s = setups(args)
    common = [*s["common"], f"data.cache_dir={work / 'cache'}"]
    timings: dict[str, float] = {}

    tick = time.perf_counter()
    teacher_dir = work / "teacher"
    if not list_checkpoints(teacher_dir / "checkpoints"):
        train(
            compose(
                [
                    *common,
                    *s["teacher_data"],
                    *s["teacher_model"],
                    f"trainer.run_dir={teacher_dir}",
                    "checkpoint.enabled=true",
                ]
            )
        )
        timings["teacher_train_s"] = time.perf_counter() - tick
    else:  # a checkpoint of an earlier run of the same command: its time is in that run's JSON
        timings["teacher_train_s"] = None
    ckpt = list_checkpoints(teacher_dir / "checkpoints")[-1]

    # the students' data, and the teacher's logits and representation on it as columns
    tick = time.perf_counter()
    student_data = [*common, *s["student_data"]]
    exported = work / "student_data_with_teacher_repr"
    done = export(
        ExportConfig(checkpoint=str(ckpt), out=str(exported), device="cpu", representation="heads"), student_data
    )
    timings["export_s"] = time.perf_counter() - tick
    timings["export_rows_written"] = done["rows"]  # 0 when an earlier run's export is reused (resumed)
    student_common = [o for o in common if not o.startswith(("experiment=", "data.name=", "data.seqrec."))]
    on_export = [*student_common, "data=parquet", f"data.dir={exported}", *s["student_train"]]

    # the history representation: a second copy, the candidate's id features left out of the teacher's pass
    tick = time.perf_counter()
    config = validate(compose(on_export))
    schema = build_source(config.data).schema
    leave_out = [f for f in s["candidate_features"] if f in schema.id_feature_names]
    with_history = work / "student_data_with_teacher_history"
    done = export(
        ExportConfig(
            checkpoint=str(ckpt),
            out=str(with_history),
            device="cpu",
            representation="history",
            candidate_features=leave_out,
        ),
        student_data,
    )
    timings["export_history_s"] = time.perf_counter() - tick
    timings["export_history_rows_written"] = done["rows"]
    history_same_per_request = history_per_request(with_history)
    on_history = [*student_common, "data=parquet", f"data.dir={with_history}", *s["student_train"]]

    # the teacher on the students' test split
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    source = build_source(config.data)
    teacher = load_teacher(ckpt, schema, None, env.device)
    results = {TEACHER: evaluate(teacher.model, split_loader(config, env, source, "test"), env, schema.tasks)}
    first = next(iter(split_loader(config, env, source, "test", 2048)))
    flops = {TEACHER: forward_flops_per_example(teacher.model, first)}
    # the history pass, once per request (per example here: each row its own request)
    history_flops = forward_flops_per_example(lambda b: teacher.history(b, tuple(leave_out)), first)
    history_config = validate(compose(on_history))  # the same rows, teacher_repr the history vector
    first_history = next(iter(split_loader(history_config, env, build_source(history_config.data), "test", 2048)))

    train_rows = sum(pq.read_metadata(f).num_rows for f in source.files("train"))
    steps_per_epoch = train_rows // s["batch_size"]  # one rank, whole batches
    selection, serves = {}, {}
    for name, (extra, serves[name]) in variants(args, ckpt).items():
        tick = time.perf_counter()
        run_dir = work / name.replace(" ", "_").replace("+", "p").replace(",", "")
        data = on_history if serves[name] == PER_REQUEST else on_export
        overrides = [*data, *s["student_model"], *extra, f"data.batch_size={s['batch_size']}"]
        results[name], selection[name] = train_selected(
            overrides, run_dir, s["max_epochs"], steps_per_epoch, s["gap_metrics"][0]
        )
        timings[f"{name}_s"] = time.perf_counter() - tick
        batch = first_history if serves[name] == PER_REQUEST else first
        flops[name] = forward_flops_per_example(gem.build_model(gem.build_data(compose(overrides))), batch)

    key = s["gap_metrics"][0]  # the target's; the others are reported beside it
    alone, top = results["student alone"][key], results[TEACHER][key]
    study = {}
    if args.seeds > 1:
        base = [*s["student_model"], f"data.batch_size={s['batch_size']}"]
        exports = {"heads": on_export, "history": on_history}
        tick = time.perf_counter()
        study = seed_study(args, base, exports, work, s["max_epochs"], steps_per_epoch, key)
        timings["seed_study_s"] = time.perf_counter() - tick
        for r in study.values():
            r["gap_closed_of_means"] = (r["mean"] - study["student alone"]["mean"]) / (
                top - study["student alone"]["mean"]
            )

    def gap(r, k):
        a, t = results["student alone"][k], results[TEACHER][k]
        return (r[k] - a) / (t - a) if t != a else float("nan")

    rows = {}
    for name, r in results.items():
        rows[name] = {k: r[k] for k in s["metrics"] if k in r}
        rows[name]["gap_closed"] = gap(r, key)
        rows[name] |= {f"gap_closed_{k}": gap(r, k) for k in s["gap_metrics"][1:]}
        rows[name]["flops"] = flops[name]
        if name in selection:
            rows[name]["selected"] = selection[name]
        serves_with = serves.get(name, "is the teacher")
        per_request = history_flops if serves_with == PER_REQUEST else 0.0
        serving = flops[name] + (flops[TEACHER] if serves_with == PER_CANDIDATE else 0.0)
        serving += per_request / args.candidates_per_request
        rows[name] |= {"teacher_at_serving": serves_with, "per_request_flops": per_request}
        rows[name]["serving_flops"] = serving
        rows[name]["teacher_over_serving_flops"] = flops[TEACHER] / serving
    cheap = {k: v for k, v in rows.items() if k != TEACHER and v["teacher_over_serving_flops"] >= 10}
    best = max(cheap, key=lambda k: cheap[k]["gap_closed"]) if cheap else None
    out = {
        "benchmark": "transfer",
        "set": args.set,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "environment": environment(),  # versions, hardware, commit
        "seeds": 1,
        "args": vars(args),
        "gap_metric": key,
        "candidate_features": leave_out,
        "candidates_per_request": args.candidates_per_request,
        "history_identical_within_each_test_request": history_same_per_request,  # None: no request ids
        "results": rows,
        "seed_study": study,  # the teacher's seed stays 0; gap_closed_of_means: to the student alone's mean
        "target": {
            "gap_closed_at_least": 0.5,
            "serving_flops_ratio_at_least": 10,
            "best_cheap_row": best,
            "best_cheap_gap_closed": cheap[best]["gap_closed"] if best else None,
            "met": bool(best and top > alone and cheap[best]["gap_closed"] >= 0.5),
        },
        "seconds": timings,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    names = [k.split("/")[-1] for k in s["metrics"]]
    head = f" {'gap':>6s} {'FLOPs':>10s} {'serving':>10s} {'/request':>10s} {'ep':>3s}"
    print(f"{'':50s} " + " ".join(f"{n:>9s}" for n in names) + head)
    for name, r in rows.items():
        values = " ".join(f"{r.get(k, float('nan')):9.4f}" for k in s["metrics"])
        epochs = r.get("selected", {}).get("epochs", "")
        costs = f"{r['flops']:10,.0f} {r['serving_flops']:10,.0f} {r['per_request_flops']:10,.0f}"
        print(f"{name:50s} {values} {r['gap_closed']:6.2f} {costs} {epochs:>3}")
    print(f"serving: FLOPs per candidate, a history pass per request shared by {args.candidates_per_request}")
    for name, r in study.items():
        print(
            f"{name:50s} {key} over {args.seeds} seeds: mean {r['mean']:.4f} [{r['min']:.4f}, {r['max']:.4f}], "
            f"gap closed {r['gap_closed_of_means']:.2f}"
        )
    print(f"target (>= half the {key} gap closed, serving >= 10x cheaper) met: {out['target']['met']} ({best})")


if __name__ == "__main__":
    main()
