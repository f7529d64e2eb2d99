"""Training: ``train(cfg)`` (gem.train.trainer), and the library API (gem.train.api) to compose a config
and build its parts for a custom loop: ``compose``, ``build_data``, ``build_model``, ``build_optimizers``,
``evaluate``; the typed config (``Config``, ``validate``, ``ConfigError``) and the trainer's step-hook
type (``StepHook``). Imported on first use, so ``import gem.train`` stays cheap."""

from importlib import import_module

_EXPORTS = {
    name: "gem.train.api"
    for name in (
        "compose",
        "config_dir",
        "build_data",
        "build_model",
        "build_optimizers",
        "evaluate",
        "Data",
        "Optimizers",
    )
}
_EXPORTS |= {
    "Config": "gem.train.config",
    "ConfigError": "gem.train.config",
    "validate": "gem.train.config",
    "StepHook": "gem.train.trainer",
    "CheckpointError": "gem.train.checkpoint",
}
__all__ = ["train", *_EXPORTS]


def train(cfg, hooks=()):
    """Train and evaluate as ``cfg`` (a composed config, see :func:`compose`) says; returns the test metrics.
    ``hooks``: callables run after every training step as ``hook(step, rank, batch)``."""
    from gem.train.trainer import train as _train

    return _train(cfg, hooks)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gem.train' has no attribute {name!r}")
