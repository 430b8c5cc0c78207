"""`python -m hpctrain [overrides]`: the Hydra entry point."""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hpctrain.config import register

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "conf")

register()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict | None:
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.config import ConfigError
    from hpctrain.data import DataError
    from hpctrain.train import TrainingError, train

    try:
        return train(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError, TrainingError, CheckpointError) as e:
        # Bad input is one line naming the fix, not a traceback.
        print(f"hpctrain: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
