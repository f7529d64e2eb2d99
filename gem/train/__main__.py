"""``python -m gem.train [overrides]``: compose configs/train.yaml with Hydra, then ``train(cfg)``.

A configuration mistake (:class:`gem.train.config.ConfigError`: a bad key or value, an impossible
layout, a missing optional package) prints one line naming the key and exits with status 1, as
Hydra does for its own override errors; ``HYDRA_FULL_ERROR=1`` shows the traceback. Every other
exception keeps its full traceback.
"""

import os
import sys

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from gem.train.api import config_dir
from gem.train.config import ConfigError
from gem.train.trainer import train

CONFIG_DIR = config_dir()  # the checkout's configs/, or gem/configs in an installed wheel


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except ConfigError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        rank = f"[rank{os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"{rank}Error in the configuration: {e}", file=sys.stderr)
        sys.exit(1)  # SystemExit passes through Hydra's handler, which would print a traceback
    finally:  # an orderly teardown, not the collective backend's threads torn down at interpreter exit
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
