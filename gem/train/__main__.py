"""``python -m gem.train [overrides]``: compose configs/train.yaml with Hydra, then ``train(cfg)``."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from gem.train.trainer import train

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
