"""``trainer.pretrain``: a pretraining stage that trains before the run, which then starts from it."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gem.train.config import Config, plain_config


def stage_and_run(cfg: DictConfig | dict, config: Config) -> tuple[DictConfig, DictConfig]:
    """``(stage, run)``: the stage is ``cfg`` with the ``trainer.pretrain`` overrides, in
    ``<run_dir>/pretrain``, checkpointed (a restarted run resumes the stage rather than repeating
    it) and not evaluated unless the overrides ask for it (``trainer.eval_every``,
    ``trainer.test=true``); the run is ``cfg`` set to start its sparse and dense archs from the
    stage's last checkpoint."""
    stage_dir = Path(config.trainer.run_dir) / "pretrain"
    raw = OmegaConf.merge(plain_config(cfg), {"trainer": {"pretrain": []}})
    checkpoint = {
        "enabled": True,
        "dir": str(stage_dir / "checkpoints"),
        "at_end": True,
        "resume": True,
        "load_from": None,
    }
    stage = OmegaConf.merge(
        raw,
        # the overrides may ask for evaluations (and a best_metric of the stage's own)
        {"trainer": {"eval_every": 0, "test": False, "best_metric": None, "best_patience": 0}},
        OmegaConf.from_dotlist(list(config.trainer.pretrain)),
        {"trainer": {"run_dir": str(stage_dir)}, "checkpoint": checkpoint},
    )
    start = {"init_from": str(stage_dir / "checkpoints"), "init_modules": ["sparse_arch", "dense_arch"]}
    return stage, OmegaConf.merge(raw, {"checkpoint": start})
