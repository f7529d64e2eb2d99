"""``python -m gem.plan [overrides]``: plan a run of ``python -m gem.train [overrides]`` for a
cluster, on this machine (a CPU is enough), and save the plan file for ``sparse.plan_file``::

    python -m gem.plan experiment=gem_large_1024 plan.world_size=1024 plan.gpus_per_node=8 plan.hbm_gb=141

The overrides are gem.train's (the same Hydra config tree) plus ``plan.*`` (configs/plan/default.yaml).
Prints the report (tables and their shards per rank, memory per rank with warnings and fixes, the
step-time model's table) and writes ``plan.out`` (default ``<trainer.run_dir>/plan.json``) and,
with matplotlib, the scaling table as a plot beside it (``scaling.png``). A
configuration or data mistake prints one line and exits 1 (``HYDRA_FULL_ERROR=1``: the traceback).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from gem.versions import VersionError, ensure_versions

    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        ensure_versions()
    except VersionError as e:
        if full:
            raise
        print(f"Error in the installed packages: {e}", file=sys.stderr)
        return 1
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gem.data.errors import DataError
    from gem.plan.planner import make_plan
    from gem.plan.steptime import compare_group_sizes, plot_scaling, step_time_table
    from gem.train.api import compose
    from gem.train.config import ConfigError, validate

    _quiet_torchrec()
    try:
        try:
            config = validate(compose(sys.argv[1:] if argv is None else argv))
        except (HydraException, OmegaConfBaseException) as e:  # an override Hydra cannot apply
            raise ConfigError(str(e).strip().splitlines()[0]) from e
        plan = make_plan(config)
        plan.step_time = step_time_table(plan)
        plan.groups = compare_group_sizes(plan)
    except (ConfigError, DataError) as e:
        if full:
            raise
        what = "configuration" if isinstance(e, ConfigError) else "data"
        print(f"Error in the {what}: {e}", file=sys.stderr)
        return 1
    out = config.plan.out or os.path.join(config.trainer.run_dir, "plan.json")
    print(plan.text())
    path = plan.save(out)
    print(f"\nplan file: {path}  (train with sparse.plan_file={path})")
    name = "scaling.png" if path.stem == "plan" else f"{path.stem}-scaling.png"
    model = str(config.model.get("_target_", "")).rsplit(".", 1)[-1]
    png = plot_scaling(
        plan.step_time, path.with_name(name), f"{model}, batch {config.data.batch_size} per GPU: predicted scaling"
    )
    if png is not None:
        print(f"scaling plot: {png}")
    return 0


def _quiet_torchrec() -> None:
    """TorchRec's planner logs a warning per data-parallel table ("Sharding spec not found": they have
    none) and one about building a Topology directly; neither is news in a dry run."""
    import logging

    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    logging.getLogger().addFilter(lambda record: not str(record.msg).startswith("Sharding spec not found"))


if __name__ == "__main__":
    sys.exit(main())
