"""Training: ``train(cfg)`` (gem.train.trainer), and the library API (gem.train.api) to compose a config
and build its parts for a custom loop: ``compose``, ``build_data``, ``build_model``, ``build_optimizers``,
``evaluate``. Imported on first use, so ``import gem.train`` stays cheap."""

_API = ("compose", "config_dir", "build_data", "build_model", "build_optimizers", "evaluate", "Data", "Optimizers")
__all__ = ["train", *_API]


def train(cfg, hooks=()):
    """Train and evaluate as ``cfg`` (a composed config, see :func:`compose`) says; returns the test metrics.
    ``hooks``: callables run after every training step as ``hook(step, rank, batch)``."""
    from gem.train.trainer import train as _train

    return _train(cfg, hooks)


def __getattr__(name):
    if name in _API:
        from gem.train import api

        return getattr(api, name)
    raise AttributeError(f"module 'gem.train' has no attribute {name!r}")
