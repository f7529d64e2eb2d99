"""Knowledge transfer (#25): a GEM teacher, DLRM students alone, with distillation, with shared
tables, with both; AUC / NE on the students' test data and FLOPs per example.

    python benchmarks/transfer.py [--teacher-examples 60000] [--student-examples 15000] [--drift 0.3] \\
        [--out benchmarks/results/transfer-cpu.json]

The teacher (``model=gem_tiny``) trains on the synthetic world at drift 0 with many examples; the
students (a small ``model=dlrm``) train on fewer examples of a later period (``data.synthetic.drift``)
and are tested on that period's test split. The teacher's logits are exported onto the students'
data (``python -m gem.transfer.export``) for offline distillation; shared tables come from the
teacher's checkpoint (``checkpoint.init_from``, every table, then trained on). FLOPs per example:
forward, ``torch.utils.flop_counter.FlopCounterMode`` over one test batch (matmuls; embedding
lookups are not FLOPs), the same counter for both models.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def compose(overrides):
    from gem.train.api import compose as _compose

    return _compose(overrides)


def forward_flops_per_example(model, batch) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch)
    return counter.get_total_flops() / batch.batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-examples", type=int, default=60000)
    parser.add_argument("--student-examples", type=int, default=15000)
    parser.add_argument("--test-examples", type=int, default=20000)
    parser.add_argument("--drift", type=float, default=0.3)
    parser.add_argument("--distill-weight", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=2, help="student epochs")
    parser.add_argument("--work", default="/tmp/gem-transfer-bench")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/transfer-cpu.json"))
    args = parser.parse_args()

    from gem.data.format.dataset import split_files
    from gem.data.pipeline.loader import build_loader
    from gem.train.checkpoint import list_checkpoints
    from gem.train.config import validate
    from gem.train.metrics import TaskEvaluator
    from gem.train.trainer import DistEnv, load_data, train
    from gem.transfer.export import ExportConfig
    from gem.transfer.export import run as export
    from gem.transfer.teacher import load_teacher

    work = Path(args.work)
    common = [
        "trainer.device=cpu",
        "trainer.progress_bar=false",
        "trainer.plots=false",
        "trainer.log_every=100",
        f"data.cache_dir={work / 'cache'}",
        "data.num_workers=0",
    ]
    teacher_data = [f"data.num_examples={{train: {args.teacher_examples}, val: 2000, test: 2000}}"]
    student_data = [
        f"data.num_examples={{train: {args.student_examples}, val: 2000, test: {args.test_examples}}}",
        f"data.synthetic.drift={args.drift}",
    ]
    teacher_model = ["model=gem_tiny", "model.dim=32", "model.num_layers=2"]
    student_model = ["model=dlrm", "model.dim=16", "model.bottom_mlp=[32]", "model.top_mlp=[32]"]
    results, timings = {}, {}

    tick = time.perf_counter()
    teacher_dir = work / "teacher"
    if not list_checkpoints(teacher_dir / "checkpoints"):
        train(
            compose(
                [
                    *common,
                    *teacher_data,
                    *teacher_model,
                    f"trainer.run_dir={teacher_dir}",
                    "checkpoint.enabled=true",
                    "trainer.epochs=1",
                ]
            )
        )
    ckpt = list_checkpoints(teacher_dir / "checkpoints")[-1]
    timings["teacher_train_s"] = time.perf_counter() - tick

    # the students' data (a later period), and the teacher's logits on it as columns
    tick = time.perf_counter()
    config = validate(compose([*common, *student_data]))
    schema, student_dir = load_data(config, DistEnv(0, 1, 0, torch.device("cpu")))
    exported = work / "student_data_with_teacher"
    export(ExportConfig(checkpoint=str(ckpt), out=str(exported), device="cpu"), [*common, *student_data])
    timings["export_s"] = time.perf_counter() - tick

    # the teacher on the students' test split, and FLOPs per example of both
    teacher = load_teacher(ckpt, schema, None, torch.device("cpu"))
    evaluator = TaskEvaluator(schema.tasks)
    first = None
    for batch in build_loader(split_files(student_dir, "test"), schema, 2048):
        first = first or batch
        evaluator.update(teacher.logits(batch), batch.labels, batch.label_mask)
    results["teacher (gem_tiny, trained at drift 0)"] = evaluator.compute()
    flops = {"teacher": forward_flops_per_example(teacher.model, first)}

    variants = {
        "student alone": [],
        "student + distillation": [
            "data=parquet",
            f"data.dir={exported}",
            f"trainer.distill.weight={args.distill_weight}",
            f"trainer.distill.temperature={args.temperature}",
        ],
        "student + shared tables": [f"checkpoint.init_from={ckpt}", "checkpoint.init_modules=[sparse_arch]"],
        "student + distillation + shared tables": [
            "data=parquet",
            f"data.dir={exported}",
            f"trainer.distill.weight={args.distill_weight}",
            f"trainer.distill.temperature={args.temperature}",
            f"checkpoint.init_from={ckpt}",
            "checkpoint.init_modules=[sparse_arch]",
        ],
    }
    for name, extra in variants.items():
        tick = time.perf_counter()
        data = student_data if "data=parquet" not in extra else ["data.num_examples={}"]
        run_dir = work / name.replace(" ", "_").replace("+", "p")
        results[name] = train(
            compose(
                [*common, *data, *student_model, f"trainer.run_dir={run_dir}", f"trainer.epochs={args.epochs}", *extra]
            )
        )
        timings[f"{name}_s"] = time.perf_counter() - tick

    import gem

    sdata = gem.build_data(compose([*common, *student_data, *student_model]))
    flops["student"] = forward_flops_per_example(gem.build_model(sdata), first)

    alone = results["student alone"]["click/auc"]
    top = results["teacher (gem_tiny, trained at drift 0)"]["click/auc"]
    rows = {}
    for name, r in results.items():
        gap = (r["click/auc"] - alone) / (top - alone) if top != alone else float("nan")
        rows[name] = {k: r[k] for k in ("click/auc", "click/ne", "conversion/auc", "conversion/ne") if k in r}
        rows[name]["click_auc_gap_closed"] = gap
    best = max(v["click_auc_gap_closed"] for k, v in rows.items() if k.startswith("student +"))
    out = {
        "benchmark": "transfer",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "args": vars(args),
        "results": rows,
        "forward_flops_per_example": flops,
        "flops_ratio_teacher_over_student": flops["teacher"] / flops["student"],
        "target": {
            "gap_closed_at_least": 0.5,
            "flops_ratio_at_least": 10,
            "met": bool(best >= 0.5 and flops["teacher"] / flops["student"] >= 10),
            "best_gap_closed": best,
        },
        "seconds": timings,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'':42s} {'click AUC':>9s} {'click NE':>9s} {'conv AUC':>9s} {'gap closed':>10s}")
    for name, r in rows.items():
        print(
            f"{name:42s} {r['click/auc']:9.4f} {r['click/ne']:9.4f} {r.get('conversion/auc', float('nan')):9.4f} "
            f"{r['click_auc_gap_closed']:10.2f}"
        )
    print(
        f"forward FLOPs per example: teacher {flops['teacher']:,.0f}, student {flops['student']:,.0f} "
        f"({flops['teacher'] / flops['student']:.1f}x)"
    )
    print(f"target (>= half the gap closed, >= 10x cheaper) met: {out['target']['met']}")


if __name__ == "__main__":
    main()
