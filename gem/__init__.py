"""gem: training GEM-style ads foundation models (jagged sequences, TorchRec tables, FSDP2 dense layers).

The library API, imported on first use (``import gem`` itself loads neither torch nor Hydra)::

    cfg = gem.compose(["debug=tiny"])          # the config `python -m gem.train debug=tiny` runs
    gem.train.train(cfg)                       # the whole run, or build the parts for your own loop:
    data = gem.build_data(cfg); model = gem.build_model(data)
    opt = gem.build_optimizers(model, data, total_steps=100); gem.evaluate(model, data, "val")

See gem/train/api.py and examples/.
"""

_API = ("compose", "config_dir", "build_data", "build_model", "build_optimizers", "evaluate")
__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        import gem.transfer  # noqa: F401  (registers its component with the trainer)
        from gem.train import api

        return getattr(api, name)
    if name in ("data", "sparse", "models", "distributed", "train"):
        import importlib

        return importlib.import_module(f"gem.{name}")
    raise AttributeError(f"module 'gem' has no attribute {name!r}")
