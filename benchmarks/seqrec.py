"""Sequential recommendation on S3-Rec-format sets: a recipe over several seeds, mean and spread.

    python benchmarks/seqrec.py [--sets LastFM Toys_and_Games Sports_and_Outdoors] [--seeds 0 1 2]
                                [--experiment seqrec_gen [--generic]] [--split test]
                                [--pretrain model.objective=masked_item ...] [--parallel N] [-- hydra overrides]

Each (set, seed) is ``python -m gem.train experiment=<experiment> data.name=<set> trainer.seed=<seed>
data.seqrec.seed=<seed>`` in its own process, with the set's own experiment where there is one
(``<experiment>_<set, lower case>``, as ``seqrec_gen_lastfm``; ``--generic``: ``<experiment>`` for every
set, as a set the recipe was not tuned on gets it). The evaluation negatives stay fixed:
the paper's file for LastFM, numpy seed 12345 otherwise. The metrics are those of the final
evaluation of ``--split``: ``test`` for the figures to report, ``val`` to choose a recipe (the runs
then validate after every epoch, ``trainer.eval_every=-1`` unless given, and skip the test split).
With ``--pretrain OVERRIDES``, each run starts from a pretraining stage of the same set and seed
(the same experiment with OVERRIDES added, e.g. S3-Rec-style masked item prediction,
``model.objective=masked_item``): its tables and dense arch, through the trainer's
``trainer.pretrain``. ``--without-prior`` also scores each run's final model with its
co-occurrence prior off (``model.cooccurrence``: the neural model alone), from the run's last
checkpoint, and reports those rows apart. ``--parallel N`` runs N at a time (on a GPU that the small
models leave mostly idle; the figures do not depend on it). The runs' folders are new ones,
``runs/seqrec/<experiment>-<tag>/<set>-<seed>`` (``--out-dir``), since the trainer resumes a
folder's checkpoint. Writes ``benchmarks/results/seqrec-<experiment>-<tag>.json`` (the tag: the
hardware unless ``--tag``) with every run's metrics and time, and prints mean +- standard deviation
per set.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402

METRICS = ("hr@1", "hr@5", "hr@10", "ndcg@5", "ndcg@10", "mrr")
# Published HR@10 / NDCG@10 (1 positive + 99 negatives): SASRec and S3-Rec from the S3-Rec paper,
# and the S3-Rec authors' own rerun.
PUBLISHED = {
    "Sports_and_Outdoors": {"SASRec": (0.4622, 0.2869), "S3-Rec": (0.5614, 0.3538), "S3-Rec rerun": (0.5664, 0.3559)},
    "Toys_and_Games": {"SASRec": (0.4663, 0.3136), "S3-Rec": (0.5530, 0.3629), "S3-Rec rerun": (0.5593, 0.3695)},
    "LastFM": {"SASRec": (0.4706, 0.2755), "S3-Rec": (0.5835, 0.3583), "S3-Rec rerun": (0.6083, 0.3577)},
}


def experiment_for(experiment: str, name: str) -> str:
    """The set's own variant of ``experiment`` where configs/experiment has one, else ``experiment``."""
    own = f"{experiment}_{name.lower()}"
    return own if (ROOT / "configs" / "experiment" / f"{own}.yaml").exists() else experiment


def run_overrides(overrides: list[str], split: str, pretrain: list[str] | None, without_prior: bool) -> list[str]:
    """A run's Hydra overrides: ``overrides``, then what ``--split``, ``--pretrain`` and
    ``--without-prior`` ask for."""
    overrides = list(overrides)
    if without_prior:  # the final model, kept for scoring it again without the prior
        overrides.append("checkpoint.enabled=true")
    if split == "val":  # choosing a recipe: validate after every epoch, never read the test split
        overrides.append("trainer.test=false")
        if not any(o.lstrip("+").startswith("trainer.eval_every=") for o in overrides):
            overrides.append("trainer.eval_every=-1")
    if pretrain:  # the trainer's pretraining stage, in <run_dir>/pretrain
        overrides.append("trainer.pretrain=[" + ",".join(f"'{o}'" for o in pretrain) + "]")
    return overrides


def run(
    experiment: str,
    name: str,
    seed: int,
    split: str,
    overrides: list[str],
    run_dir: Path,
    pretrain: list[str] | None = None,
    generic: bool = False,
    without_prior: bool = False,
) -> dict:
    tick = time.perf_counter()
    overrides = run_overrides(overrides, split, pretrain, without_prior)
    experiment = experiment if generic else experiment_for(experiment, name)
    cmd = [
        sys.executable,
        "-m",
        "gem.train",
        f"experiment={experiment}",
        f"data.name={name}",
        f"trainer.seed={seed}",
        f"data.seqrec.seed={seed}",
        f"trainer.run_dir={run_dir}",
        "trainer.progress_bar=false",
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=_child_env(), stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if r["kind"] == split]
    if not evaluations:
        raise SystemExit(
            f"{run_dir}: the run logged no {split!r} metrics (data.seqrec.refit=true writes no validation split)"
        )
    final = evaluations[-1]
    return {
        "set": name,
        "experiment": experiment,
        "seed": seed,
        "split": split,
        "step": final["step"],
        "seconds": round(time.perf_counter() - tick, 1),
        **{m: final[f"next_item/{m}"] for m in METRICS},
        # the evaluation set's sampling error (over its users), which more seeds do not shrink
        **{f"{m}_se": final[f"next_item/{m}_se"] for m in ("hr@10", "ndcg@10")},
        **({"best_step": final["best_step"]} if "best_step" in final else {}),  # trainer.best_metric's pick
        **({"without_prior": score_without_prior(run_dir, split)} if without_prior else {}),
    }


def score_without_prior(run_dir: Path, split: str) -> dict:
    """The metrics of ``run_dir``'s final model on ``split`` with the co-occurrence prior off: the
    neural model alone (in its own process, as the runs are)."""
    script = (
        "import json, sys; from benchmarks.seqrec import _without_prior; "
        "print(json.dumps(_without_prior(sys.argv[1], sys.argv[2])))"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run_dir), split], cwd=ROOT, env=_child_env(), check=True,
                          capture_output=True, text=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def _child_env() -> dict:
    """This environment with the repository first on PYTHONPATH, for the runs' processes."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"PYTHONPATH": path}


def _without_prior(run_dir: str, split: str) -> dict:
    from omegaconf import OmegaConf

    import gem
    from gem.train.initialize import init_from_checkpoint

    config = OmegaConf.load(Path(run_dir) / "config.yaml")
    if not config.model.get("cooccurrence"):
        raise SystemExit(f"{run_dir}: the run has no co-occurrence prior (model.cooccurrence) to leave out")
    config.trainer.run_dir = str(Path(run_dir) / "without_prior")
    config.checkpoint.enabled = False
    config.trainer.pretrain = []
    data = gem.build_data(config)
    model = gem.build_model(data)
    init_from_checkpoint(model, str(Path(run_dir) / "checkpoints"), ["sparse_arch", "dense_arch"])
    model.dense_arch.cooccurrence = 0.0
    metrics = gem.evaluate(model, data, split)
    return {m: metrics[f"next_item/{m}"] for m in METRICS}


def _spread(values: list[float]) -> dict:
    """Mean and standard deviation over seeds (0 for one run)."""
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(results: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["set"] for r in results):
        runs = [r for r in results if r["set"] == name]
        out[name] = {m: _spread([r[m] for r in runs]) for m in METRICS}
        out[name]["seconds"] = statistics.mean(r["seconds"] for r in runs)
        for m in ("hr@10", "ndcg@10"):  # a run's standard error over the split's users
            out[name][f"{m}_se"] = statistics.mean(r[f"{m}_se"] for r in runs)
        if all("without_prior" in r for r in runs):
            out[name]["without_prior"] = {m: _spread([r["without_prior"][m] for r in runs]) for m in METRICS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["LastFM", "Toys_and_Games", "Sports_and_Outdoors"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--experiment", default="seqrec_gen")
    parser.add_argument("--generic", action="store_true", help="--experiment for every set, not a set's own variant")
    parser.add_argument("--split", default="test", choices=["test", "val"])
    parser.add_argument("--tag", default=None, help="file name suffix (default: the hardware, slugged)")
    parser.add_argument(
        "--out-dir", default=None, help="the runs' folders (default: runs/seqrec/<experiment>-<tag>); each must be new"
    )
    parser.add_argument(
        "--pretrain",
        nargs="+",
        metavar="OVERRIDE",
        help="pretrain each run first with these overrides added (e.g. model.objective=masked_item)",
    )
    parser.add_argument(
        "--without-prior", action="store_true", help="also score each final model without its co-occurrence prior"
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    env = environment()
    tag = args.tag or "".join(c if c.isalnum() else "-" for c in env["hardware"].lower()).strip("-")
    out_dir = Path(args.out_dir or ROOT / "runs" / "seqrec" / f"{args.experiment}-{tag}")
    names, seeds = zip(*[(name, seed) for name in args.sets for seed in args.seeds])
    for name, seed in zip(names, seeds):  # a run folder with a checkpoint would resume that run instead of training
        if (out_dir / f"{name}-{seed}").exists():
            raise SystemExit(
                f"{out_dir / f'{name}-{seed}'} holds an earlier run, which the trainer would resume: remove it, "
                "or give this invocation another --tag or --out-dir"
            )

    def one(name: str, seed: int) -> dict:
        """A run's record, or the reason it failed (the others' records are kept either way)."""
        run_dir = out_dir / f"{name}-{seed}"
        try:
            return run(
                args.experiment,
                name,
                seed,
                args.split,
                args.overrides,
                run_dir,
                args.pretrain,
                args.generic,
                args.without_prior,
            )
        except (subprocess.CalledProcessError, SystemExit) as error:
            reason = f"exit status {error.returncode}" if isinstance(error, subprocess.CalledProcessError) else error
            return {"set": name, "seed": seed, "failed": f"{reason} (its error is in the output above; {run_dir})"}

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        records = list(pool.map(one, names, seeds))
    results, failed = [r for r in records if "failed" not in r], [r for r in records if "failed" in r]
    summary = summarize(results)
    print(
        f"\n{'set':<22} {'HR@10':>15} {'NDCG@10':>15} {'HR@1':>15} {'MRR':>15} {'s/run':>6}  published HR@10 / NDCG@10"
        "\n(mean +- standard deviation over seeds; a run's standard error over the split's users below)"
    )
    for name, s in summary.items():
        cell = lambda m, s=s: f"{s[m]['mean']:.4f}+-{s[m]['std']:.4f}"  # noqa: E731
        refs = "; ".join(f"{k} {h:.4f}/{n:.4f}" for k, (h, n) in PUBLISHED.get(name, {}).items())
        print(
            f"{name:<22} {cell('hr@10'):>15} {cell('ndcg@10'):>15} {cell('hr@1'):>15} {cell('mrr'):>15} "
            f"{s['seconds']:>6.0f}  {refs}"
        )
        print(f"{'':<22} {'se ' + format(s['hr@10_se'], '.4f'):>15} {'se ' + format(s['ndcg@10_se'], '.4f'):>15}")
        if "without_prior" in s:
            alone = lambda m, s=s: f"{s['without_prior'][m]['mean']:.4f}+-{s['without_prior'][m]['std']:.4f}"  # noqa: E731
            cells = " ".join(f"{alone(m):>15}" for m in ("hr@10", "ndcg@10", "hr@1", "mrr"))
            print(f"{'  without the prior':<22} {cells}")
    out = ROOT / "benchmarks" / "results" / f"seqrec-{args.experiment}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "seqrec",
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                **env,
                "experiment": args.experiment,
                "split": args.split,
                "overrides": args.overrides,
                "pretrain": args.pretrain,
                "without_prior": args.without_prior,
                "summary": summary,
                "published": PUBLISHED,
                "runs": results,
                **({"failed": failed} if failed else {}),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    if failed:
        raise SystemExit(
            "runs that failed (left out of the summary): "
            + "; ".join(f"{r['set']} seed {r['seed']}: {r['failed']}" for r in failed)
        )


if __name__ == "__main__":
    main()
