"""`python -m hpctrain [overrides]`: the Hydra entry point (trains here, or submits with hydra/launcher=slurm);
`python -m hpctrain plan [overrides]`: the planner; `python -m hpctrain preflight`: a cluster health check."""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hpctrain.config import register

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "conf")

register()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict | None:
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.config import ConfigError
    from hpctrain.data import DataError
    from hpctrain.job import Stopped, quiet_other_ranks
    from hpctrain.train import TrainingError, train

    hc = HydraConfig.get()
    if hc.mode == RunMode.RUN and str(hc.launcher.get("_target_", "")).startswith("hydra_plugins.hpctrain_launcher."):
        # `python -m hpctrain hydra/launcher=slurm ...`: submit this one run instead of training here.
        from hydra.utils import instantiate

        launcher = instantiate(hc.launcher)
        return launcher.submit_run(cfg, hc.runtime.output_dir, OmegaConf.to_container(hc.job_logging, resolve=True))
    quiet_other_ranks()
    try:
        return train(cfg, hc.runtime.output_dir)
    except (ConfigError, DataError, TrainingError, CheckpointError) as e:
        # Bad input is one line naming the fix, not a traceback.
        print(f"hpctrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Stopped as e:
        print(f"hpctrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def plan_main(overrides: list[str]) -> int:
    """Compose the same config as a run (no run directory, no logging setup) and print its layout plan."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(a in ("-h", "--help") for a in overrides):
        print("usage: python -m hpctrain plan [hydra overrides], e.g. model=llama_70b parallel.dp=8 "
              "parallel.tp=8 parallel.pp=4 cluster.gpu_mem_gb=80\nprints the layer-to-stage map, per-device "
              "memory, pipeline bubble and FLOPs per step of that layout, without allocating the model")
        return 0
    try:
        with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"hpctrain: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    from hpctrain.plan import main as plan

    return plan(cfg)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "plan":
        sys.exit(plan_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "preflight":
        from hpctrain.preflight import main as preflight

        sys.exit(preflight(sys.argv[2:]))
    main()
