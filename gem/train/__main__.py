"""``python -m gem.train [overrides]``: compose configs/train.yaml with Hydra, then ``train(cfg)``."""

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from gem.train.api import config_dir
from gem.train.trainer import train

CONFIG_DIR = config_dir()  # the checkout's configs/, or gem/configs in an installed wheel


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    finally:  # an orderly teardown, not the collective backend's threads torn down at interpreter exit
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
