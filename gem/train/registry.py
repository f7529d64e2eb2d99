"""Outside components of a training run, registered by the packages that provide them.

gem.train never imports a package above it; such a package registers, under the config section it
serves, the dotted path of a factory ``factory(config) -> Component | None``, which the trainer
imports when a run is set up (gem.train.components.outside_components). Registering imports
nothing, so ``import gem`` stays cheap:

    register("trainer.distill", "gem.transfer.components:distillation")   # gem/transfer/__init__.py
"""

from __future__ import annotations

_REGISTRY: dict[str, str] = {}  # config section -> "module:factory"


def register(section: str, factory: str) -> None:
    """The component factory ``"module:function"`` serves the config keys under ``section``."""
    _REGISTRY[section] = factory


def registered() -> dict[str, str]:
    """``{config section: "module:factory"}`` of every registered component."""
    return dict(_REGISTRY)
