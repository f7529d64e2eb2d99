"""Package layout (the metadata is in pyproject.toml).

The Hydra config tree lives at the top of the repository (``configs/``) and ships inside the
wheel as ``gem/configs/``, so that ``python -m gem.train`` finds it after ``pip install`` from
any directory (gem.train.api.config_dir() looks in both places).
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gem", "gem.*", "kernels", "kernels.*"]) + ["gem.configs"],
    package_dir={"gem.configs": "configs"},
    package_data={"gem.configs": ["*.yaml", "**/*.yaml"]},
)
